TEST_SUITE("runs") {}
