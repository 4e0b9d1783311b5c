// doctest's main, compiled once without the precompiled header (see tests/meson.build).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
