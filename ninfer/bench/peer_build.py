"""llama.cpp from source for `ninfer bench peer`: unpack it from the llama-cpp-python sdist, prune it to
what llama-bench and llama-perplexity need with the CPU and CUDA backends (plus the HF -> GGUF converter
and its gguf-py), build those two tools, and convert HF checkpoints to GGUF with llama.cpp's own converter.

The pruned tree is small enough to travel to a machine without network. Pruning keeps a fixed list of
paths (KEEP); in the CMakeLists left, each `add_subdirectory(x)` of a directory pruning removed is guarded
by `if (EXISTS ...)`, so the upstream build files stay otherwise untouched.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
TOOLS = ("llama-bench", "llama-perplexity")
# Relative to the llama.cpp root. Everything else goes: other ggml backends, models/ (vocab GGUFs),
# docs, examples, tests, the server and its web UI, the app, mtmd's audio library.
KEEP = (
    "CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "licenses",
    "vendor/CMakeLists.txt", "vendor/cpp-httplib", "vendor/nlohmann", "vendor/sheredom", "vendor/hash",
    "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda",
    "tools/CMakeLists.txt", "tools/llama-bench", "tools/perplexity",
    "convert_hf_to_gguf.py", "conversion", "gguf-py/gguf", "gguf-py/pyproject.toml", "gguf-py/LICENSE",
)
# plain files directly under ggml/src (ggml.c, gguf.cpp, the backend registry, ...) are kept too
# FlashAttention vector kernels for the KV types compared (K and V of one type); f16-f16 is always built
FA_QUANTS = "f16-f16,q8_0-q8_0,q4_0-q4_0"


class PeerError(Exception):
    """A user-facing failure: printed as one line, no traceback."""


def _sdist_root(members: list[str]) -> str:
    for m in members:
        parts = m.split("/")
        if len(parts) >= 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3] == "CMakeLists.txt":
            return "/".join(parts[:3])
    raise PeerError("the archive has no vendor/llama.cpp/CMakeLists.txt: not a llama-cpp-python sdist")


def download(dest: Path) -> Path:
    """`pip download` the sdist (the registry's ordinary client) into dest; the archive's path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", SDIST, "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not got:
        raise PeerError(f"pip download {SDIST} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return got[-1]


def keep(rel: str) -> bool:
    """Whether a path (relative to the llama.cpp root, '/'-separated) survives pruning."""
    if any(rel == k or rel.startswith(k + "/") for k in KEEP):
        return True
    parts = rel.split("/")
    return len(parts) == 3 and parts[:2] == ["ggml", "src"]  # ggml/src/<file>, not its backend dirs


def guard_subdirs(cmake: Path) -> None:
    """Wrap each `add_subdirectory(name)` of a directory that is gone in `if (EXISTS ...)` (once)."""
    lines, out = cmake.read_text().splitlines(keepends=True), []
    for i, line in enumerate(lines):
        m = re.match(r"^([ \t]*)add_subdirectory\(([\w./-]+)\)[ \t]*$", line.rstrip("\n"))
        guard = f"if (EXISTS ${{CMAKE_CURRENT_SOURCE_DIR}}/{m.group(2)}) # pruned" if m else ""
        if not m or (cmake.parent / m.group(2)).is_dir() or (i and guard in lines[i - 1]):
            out.append(line)
            continue
        ind = m.group(1)
        out.append(f"{ind}{guard}\n{ind}    add_subdirectory({m.group(2)})\n{ind}endif()\n")
    cmake.write_text("".join(out))


def prune_tree(root: Path) -> None:
    """Delete every path of an unpacked llama.cpp root that KEEP does not name, then guard the CMakeLists."""
    if not (root / "CMakeLists.txt").is_file() or not (root / "ggml" / "src").is_dir():
        raise PeerError(f"{root} is not a llama.cpp source tree (no CMakeLists.txt and ggml/src)")
    for dirpath, dirnames, filenames in os.walk(root, topdown=True):
        base = Path(dirpath)
        for name in list(dirnames):
            rel = (base / name).relative_to(root).as_posix()
            if keep(rel):
                continue
            if any(k.startswith(rel + "/") for k in KEEP):
                continue  # a parent of something kept: walk into it
            shutil.rmtree(base / name)
            dirnames.remove(name)
        for name in filenames:
            if not keep((base / name).relative_to(root).as_posix()):
                (base / name).unlink()
    for cmake in root.rglob("CMakeLists.txt"):
        guard_subdirs(cmake)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def prepare(sdist: Path, out: Path) -> int:
    """Unpack vendor/llama.cpp of the sdist into out (replacing it) and prune it; its size in bytes."""
    if not sdist.is_file():
        raise PeerError(f"no such sdist: {sdist}")
    try:
        tf = tarfile.open(sdist)
    except tarfile.TarError as e:
        raise PeerError(f"{sdist} is not a tar archive: {e}")
    with tf, tempfile.TemporaryDirectory(dir=out.parent if out.parent.is_dir() else None) as tmp:
        prefix = _sdist_root(tf.getnames())
        members = [m for m in tf.getmembers() if m.name.startswith(prefix + "/") and (m.isfile() or m.isdir())]
        tf.extractall(tmp, members=members, filter="data")
        src = Path(tmp) / prefix
        prune_tree(src)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(out))
    return tree_bytes(out)


# -- build ---------------------------------------------------------------------------------------
def cmake_args(src: Path, build: Path, cuda: bool, arch: str) -> list[str]:
    args = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_SUBPROCESS=OFF",
            "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON", "-DGGML_NATIVE=ON",
            "-DCMAKE_SKIP_INSTALL_ALL_DEPENDENCY=ON", "-DGGML_CCACHE=OFF",
            # build-info would otherwise report the commit of the git checkout the tree sits in
            f"-DLLAMA_BUILD_COMMIT={SDIST.replace('==', '-')}", "-DLLAMA_BUILD_NUMBER=0"]
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DGGML_CUDA_FA_QUANTS={FA_QUANTS}",
                 "-DGGML_CUDA_NCCL=OFF"]
    return args


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None)


def build(src: Path, build_dir: Path, *, backend: str = "auto", arch: str = "90", jobs: int | None = None,
          save_bin: Path | None = None, log=print) -> dict:
    """Configure and build the two tools; with save_bin copy them and their shared libraries there."""
    if not (src / "tools" / "llama-bench").is_dir():
        raise PeerError(f"{src} is not a prepared llama.cpp tree (run `ninfer bench peer prepare` first)")
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise PeerError(f"{tool} is not on PATH")
    nvcc = find_nvcc()
    cuda = backend == "cuda" or (backend == "auto" and nvcc is not None)
    if cuda and nvcc is None:
        raise PeerError("--backend cuda needs nvcc on PATH")
    env = dict(os.environ)
    if cuda and shutil.which("nvcc") is None:
        env["PATH"] = f"{Path(nvcc).parent}:{env['PATH']}"
    jobs = jobs or os.cpu_count() or 1
    t0 = time.time()
    for cmd in (cmake_args(src, build_dir, cuda, arch),
                ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS]):
        log("+ " + " ".join(cmd))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
            raise PeerError(f"{cmd[0]} {cmd[1]} failed (exit {r.returncode}):\n{tail}")
    seconds = time.time() - t0
    bins = build_dir / "bin"
    if save_bin:
        save_bin.mkdir(parents=True, exist_ok=True)
        for p in bins.iterdir():
            dst = save_bin / p.name
            if p.name not in TOOLS and ".so" not in p.name:
                continue
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            if p.is_symlink():  # libfoo.so -> libfoo.so.0 -> libfoo.so.0.x: one copy of the bytes
                dst.symlink_to(os.readlink(p))
            else:
                shutil.copy2(p, dst)
        bins = save_bin
    return {"backend": "cuda" if cuda else "cpu", "cuda_arch": arch if cuda else None, "jobs": jobs,
            "seconds": round(seconds, 1), "bin_dir": str(bins)}


def tool(bin_dir: Path, name: str) -> Path:
    p = Path(bin_dir) / name
    if not p.is_file():
        raise PeerError(f"no {name} in {bin_dir} (build llama.cpp with `ninfer bench peer build`)")
    return p


# -- HF -> GGUF ----------------------------------------------------------------------------------
def convert(src: Path, model_dir: Path, out: Path, outtype: str = "bf16", pre: str | None = None, log=print) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an HF directory, with the tree's own gguf-py (peer_convert.py says
    what differs from a plain run)."""
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise PeerError(f"no convert_hf_to_gguf.py in {src}")
    if not (model_dir / "config.json").is_file():
        raise PeerError(f"no config.json in {model_dir}")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "ninfer.bench.peer_convert", str(src), *(["--pre", pre] if pre else []), "--",
           str(model_dir), "--outfile", str(out), "--outtype", outtype]
    log("+ " + " ".join(cmd))
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-12:])
        raise PeerError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {r.returncode}):\n{tail}")
    return out
