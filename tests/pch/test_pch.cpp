// The one translation unit of the library that owns the test executables' precompiled header
// (tests/meson.build: test_pch_owner). Meson builds a target's PCH only for a target with sources;
// this file gives it one and defines nothing.
