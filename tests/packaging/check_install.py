#!/usr/bin/env python3
"""Install loom into a temporary DESTDIR and build two consumers against the installed tree.

1. `meson install --destdir` of the configured build (no rebuild: loom is header-only).
2. A pkg-config consumer: g++ with `pkg-config --cflags --libs loom` (prefix redirected into the
   DESTDIR with --define-variable), -Wall -Wextra -Wpedantic -Werror, then run.
3. A CMake consumer: find_package(Torch) + find_package(loom 0.1) -> loom::loom, built with Ninja
   and run; and a request for an incompatible version (99.0) must fail in loomConfigVersion.cmake.

Each consumer prints one line, compared exactly. Exit 0 = pass, 1 = fail, 77 = skipped (no cmake).

Usage: check_install.py --meson MESON --builddir DIR --prefix PREFIX --version V --consumer DIR
                        [--cmake CMAKE] [--workdir DIR] -- COMPILER [ARGS...]
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile


def run(cmd, env=None, cwd=None, expect_ok=True):
    print("$", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    p = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.stdout:
        print(p.stdout.rstrip(), flush=True)
    if expect_ok and p.returncode != 0:
        raise SystemExit(f"FAIL: exit code {p.returncode}: {' '.join(map(str, cmd))}")
    return p


def check(cond, message):
    if not cond:
        raise SystemExit("FAIL: " + message)
    print("ok:", message, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meson", required=True)
    ap.add_argument("--builddir", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--consumer", required=True)
    ap.add_argument("--cmake", default="")
    ap.add_argument("--torch-cmake-dir", default="",
                    help="share/cmake of the LibTorch loom was built with (a pip or zip LibTorch); empty: the system's")
    ap.add_argument("--workdir", default="", help="stable scratch folder (lets ccache hit on reruns); default: a temp dir")
    ap.add_argument("compiler", nargs="+")
    a = ap.parse_args()

    expected = f"loom {a.version} consumer: sum 7.5 mean 0.75 world 1"
    if a.workdir:
        tmp = os.path.abspath(a.workdir)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    else:
        tmp = tempfile.mkdtemp(prefix="loom-install-")
    root = os.path.join(tmp, "root")
    prefix = root + a.prefix  # the prefix inside the DESTDIR
    ok = False
    try:
        # --- 1. install ---------------------------------------------------------------------
        run([a.meson, "install", "-C", a.builddir, "--destdir", root, "--no-rebuild", "--quiet"])
        pc = os.path.join(prefix, "share", "pkgconfig", "loom.pc")
        cm = os.path.join(prefix, "share", "cmake", "loom")
        for path in [pc, os.path.join(cm, "loomConfig.cmake"), os.path.join(cm, "loomConfigVersion.cmake"),
                     os.path.join(prefix, "include", "loom", "build_config.hpp"),
                     os.path.join(prefix, "include", "loom", "comm", "local.hpp")]:
            check(os.path.isfile(path), f"installed {os.path.relpath(path, root)}")
        if os.path.isfile(os.path.join(a.builddir, "tools", "loom-trace")):  # built when CLI11 is there
            tool = os.path.join(prefix, "bin", "loom-trace")
            check(os.path.isfile(tool), f"installed {os.path.relpath(tool, root)}")
            check("flight records" in run([tool, "--help"]).stdout, "the installed loom-trace runs (--help)")
        check(not os.path.exists(os.path.join(prefix, "include", "loom", "meson.build")),
              "include/loom/meson.build is not installed")
        check(not os.path.exists(os.path.join(prefix, "include", "loom", "data")),
              "the examples' data readers (examples/common/data) are not installed under include/loom")
        with open(pc) as f:
            requires = [l for l in f if l.startswith("Requires")]
        check(all("range-v3" not in l and "doctest" not in l for l in requires),
              f"loom.pc requires no package without a .pc file ({''.join(requires).strip()})")

        # --- 2. pkg-config consumer ---------------------------------------------------------
        env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "share", "pkgconfig"))
        flags = run(["pkg-config", f"--define-variable=prefix={prefix}", "--cflags", "--libs", "loom"],
                    env=env).stdout.strip()
        check(f"-I{prefix}/include" in flags, "pkg-config points at the installed headers")
        exe = os.path.join(tmp, "consumer_pkgconfig")
        run(a.compiler + ["-std=c++20", "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                          os.path.join(a.consumer, "consumer.cpp"), "-o", exe] + shlex.split(flags))
        out = run([exe]).stdout.strip()
        check(out == expected, f"pkg-config consumer printed '{out}'")

        # --- 3. CMake consumer --------------------------------------------------------------
        if not a.cmake:
            print("SKIP: cmake not found; the CMake consumer was not built")
            ok = True
            return 77
        compiler = list(a.compiler)
        cm_args = []
        if os.path.basename(compiler[0]) == "ccache" and len(compiler) > 1:
            cm_args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
            compiler = compiler[1:]
        cm_args.append("-DCMAKE_CXX_COMPILER=" + (shutil.which(compiler[0]) or compiler[0]))
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        if a.torch_cmake_dir:
            # The consumer's find_package(Torch) must find the same LibTorch (and its Caffe2 config,
            # which TorchConfig would otherwise look for in the system's folders first).
            cm_args += [f"-DTorch_DIR={a.torch_cmake_dir}/Torch", f"-DCaffe2_DIR={a.torch_cmake_dir}/Caffe2"]
        bdir = os.path.join(tmp, "cmake-build")
        conf = run([a.cmake, "-S", a.consumer, "-B", bdir, f"-DCMAKE_PREFIX_PATH={prefix}"] + generator + cm_args).stdout
        check(f"loom_DIR={cm}" in conf, "find_package(loom) found the installed config")
        run([a.cmake, "--build", bdir])
        out = run([os.path.join(bdir, "consumer")]).stdout.strip()
        check(out == expected, f"CMake consumer printed '{out}'")
        bad = run([a.cmake, "-S", a.consumer, "-B", os.path.join(tmp, "cmake-v99"), f"-DCMAKE_PREFIX_PATH={prefix}",
                   "-DLOOM_REQUESTED_VERSION=99.0"] + generator + cm_args, expect_ok=False)
        check(bad.returncode != 0 and 'requested version "99.0"' in bad.stdout,
              "find_package(loom 99.0) is refused by loomConfigVersion.cmake")
        ok = True
        return 0
    finally:
        if ok and not a.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"(kept {tmp} for inspection)")


if __name__ == "__main__":
    sys.exit(main())
