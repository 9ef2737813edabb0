"""llama.cpp side by side with ninfer on the same weights: speed at a depth and next-token KL of quantized KV.

    ninfer bench peer prepare --download --out .carry/llama.cpp        # or --sdist llama_cpp_python-0.3.36.tar.gz
    ninfer bench peer build --src .carry/llama.cpp --build-dir /tmp/lcpp-build [--cuda-arch 90] [--save-bin DIR]
    ninfer bench peer convert --src .carry/llama.cpp --model HFDIR --out F.gguf [--pre gpt-2]
    ninfer bench peer speed --model HFDIR --gguf F --depths 0,32K,128K --kv f16,q8_0,q4_0 --kv-dtype bf16,int8,rk4v4-e8
    ninfer bench peer kl --model HFDIR --gguf F [--text FILE] [--ctx 512]
    ninfer bench peer all --out-dir DIR [--stages build,models,speed,kl] [--models qwen3-8b,smollm2]

Speed: llama-bench (-fa 1 -ngl 99, -p/-n at each -d depth, -ctk = -ctv) against ninfer at batch 1 with prefix
reuse on: the depth's tokens are prefilled once untimed, then the prefill of --prompt fresh tokens after them
and --gen tokens decoded after them are timed, as llama-bench's pp and tg at a depth. KV bytes per token: the
llama.cpp KV cache line (K + V MiB over cells) and ninfer's pool. KL: llama-perplexity saves f16-KV logits
(--kl-divergence-base) and scores q8_0 / q4_0 KV against them; ninfer scores its kv-dtypes against bf16 KV
(kv_sim: K and V quantized inside the float32 model) on the same tokens, -c chunks and scored positions.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ninfer.bench import peer_build as B
from ninfer.bench import peer_run as R
from ninfer.bench.peer_build import PeerError
from ninfer.config import add_engine_args, parse_token_count

STAGES = ("build", "models", "speed", "kl")
MODELS = ("qwen3-8b", "smollm2")


def _tokens(text: str, what: str) -> list[int]:
    try:
        vals = [0 if s.strip() == "0" else parse_token_count(s.strip()) for s in str(text).split(",") if s.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise PeerError(f"{what}: {e}")
    if not vals or min(vals) < 0:
        raise PeerError(f"{what}: give comma-separated token counts >= 0, got {text!r}")
    return vals


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    vals = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise PeerError(f"{what}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}")
    return vals


def _kv_dtypes(text: str) -> list[str]:
    from ninfer.bench import kv_sim
    try:
        return kv_sim.codec_names(text)
    except (ValueError, KeyError) as e:
        raise PeerError(f"--kl-kv-dtype / --reference: {e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="{prepare,build,convert,speed,kl,all}")
    pr = sub.add_parser("prepare", help="unpack and prune llama.cpp from the llama-cpp-python sdist")
    g = pr.add_mutually_exclusive_group(required=True)
    g.add_argument("--sdist", type=Path, help=f"the {B.SDIST} sdist (.tar.gz)")
    g.add_argument("--download", action="store_true", help=f"pip download {B.SDIST} first")
    pr.add_argument("--out", type=Path, default=Path(".carry/llama.cpp"), help="pruned tree (default %(default)s)")

    def build_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--src", type=Path, default=Path(".carry/llama.cpp"), help="prepared tree (default %(default)s)")
        q.add_argument("--build-dir", type=Path, default=Path("/tmp/lcpp-build"))
        q.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default %(default)s)")
        q.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto",
                       help="auto: CUDA when nvcc is found (default %(default)s)")
        q.add_argument("--jobs", type=int, default=None, help="build jobs (default: all cores)")
    bd = sub.add_parser("build", help="build llama-bench and llama-perplexity")
    build_args(bd)
    bd.add_argument("--save-bin", type=Path, default=None, help="copy the tools and their libraries here")

    cv = sub.add_parser("convert", help="HF checkpoint -> GGUF with llama.cpp's convert_hf_to_gguf.py")
    cv.add_argument("--src", type=Path, default=Path(".carry/llama.cpp"))
    cv.add_argument("--model", required=True, help="HF directory or alias (smollm2)")
    cv.add_argument("--out", type=Path, required=True)
    cv.add_argument("--outtype", default="bf16", choices=["bf16", "f16", "f32"])
    cv.add_argument("--pre", default=None, help="tokenizer.ggml.pre to write instead of the hash lookup")

    def bench_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--src", type=Path, default=Path(".carry/llama.cpp"), help="prepared tree (its gguf-py is "
                       "used where the gguf package is not installed)")
        q.add_argument("--bin-dir", type=Path, default=Path("/tmp/lcpp-build/bin"), help="llama.cpp tools")
        q.add_argument("--kv", default="f16,q8_0,q4_0", help="llama.cpp KV types, K = V (default %(default)s)")
        q.add_argument("--ngl", type=int, default=99, help="llama.cpp layers on the GPU (default %(default)s)")
        q.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON ('-' = stdout)")
    sp = sub.add_parser("speed", help="prefill / decode tok/s at depths, both engines")
    sp.add_argument("--model", required=True, help="HF directory (alias smollm2)")
    sp.add_argument("--gguf", type=Path, required=True, help="GGUF of the same weights")
    bench_args(sp)
    speed_args(sp)
    add_engine_args(sp, model_positional=False)
    sp.set_defaults(kv_dtype="bf16,int8,rk4v4-e8")

    kl = sub.add_parser("kl", help="next-token KL of quantized KV vs each engine's 16-bit KV")
    kl.add_argument("--model", required=True, help="HF directory (alias smollm2)")
    kl.add_argument("--gguf", type=Path, required=True)
    bench_args(kl)
    kl_args(kl)
    kl.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ninfer-peer",
                    help="where llama-perplexity's f16-KV logits go (n_vocab x 2 bytes per scored token)")

    al = sub.add_parser("all", help="build, convert, speed and kl for the listed models; JSON and a table to --out-dir")
    build_args(al)
    al.add_argument("--out-dir", type=Path, required=True)
    al.add_argument("--work", type=Path, default=Path(".carry/peer"), help="checkpoints and GGUFs (default %(default)s)")
    al.add_argument("--bin-dir", type=Path, default=None, help="prebuilt tools: skip the build")
    al.add_argument("--save-bin", type=Path, default=None)
    al.add_argument("--stages", default=",".join(STAGES), help="subset of %(default)s")
    al.add_argument("--models", default=",".join(MODELS), help="subset of %(default)s")
    al.add_argument("--kv", default="f16,q8_0,q4_0")
    al.add_argument("--ngl", type=int, default=99)
    speed_args(al)
    kl_args(al)
    add_engine_args(al, model_positional=False)
    al.set_defaults(kv_dtype="bf16,int8,rk4v4-e8")


def speed_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--depths", default="0,32K,128K", help="context depths (default %(default)s)")
    q.add_argument("--prompt", type=int, default=512, help="prefill tokens timed at each depth (default %(default)s)")
    q.add_argument("--gen", type=int, default=128, help="decoded tokens timed at each depth (default %(default)s)")
    q.add_argument("--repeats", type=int, default=2, help="timed repeats (default %(default)s)")
    q.add_argument("--engines", default="llama.cpp,ninfer", help="which engines' speed to run (default %(default)s)")


def kl_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: the shipped passages but the "
                   "key-centring calibration one, joined)")
    q.add_argument("--ctx", type=int, default=512, help="chunk length, llama-perplexity -c (default %(default)s)")
    q.add_argument("--kl-kv-dtype", default="int8,rk4v4,rk4v4-e8,int8+c,rk4v4+c,rk4v4-e8+c", help="ninfer formats scored (default %(default)s)")
    q.add_argument("--reference", default="bf16", help="ninfer reference KV format (default %(default)s)")
    q.add_argument("--kl-device", default="auto", help="where ninfer's float32 model runs for KL")


# -- shared pieces --------------------------------------------------------------------------------
def default_text(out: Path) -> Path:
    from ninfer.bench import kv_sim
    out.parent.mkdir(parents=True, exist_ok=True)
    from ninfer.kvcache import centering
    docs = kv_sim.documents()
    docs.pop(centering.PASSAGE.stem, None)  # key centring calibrates on it: never scored
    out.write_text("\n\n".join(docs.values()), encoding="utf-8")
    return out


def use_gguf_py(src: Path) -> None:
    """Import gguf from the llama.cpp tree when the package is not installed (machines without network)."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None and (Path(src) / "gguf-py" / "gguf").is_dir():
        sys.path.append(str(Path(src) / "gguf-py"))


def model_dir(name: str) -> Path:
    from ninfer.checkpoints import resolve_model
    try:
        return resolve_model(name)
    except ValueError as e:
        raise PeerError(str(e))


def write(path: str | Path | None, obj: dict[str, Any]) -> None:
    if path is None:
        return
    text = json.dumps(obj, indent=1, default=str)
    if str(path) == "-":
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")
    R.stderr_log(f"wrote {path}")


def speed(args: argparse.Namespace, model: str | Path, gguf: Path) -> dict[str, Any]:
    from ninfer.bench import _timing as T
    depths = _tokens(args.depths, "--depths")
    kvs = _names(args.kv, R.LLAMA_KV, "--kv")
    try:
        nkvs = T.kv_dtypes(args.kv_dtype)
    except ValueError as e:
        raise PeerError(f"--kv-dtype: {e}")
    if args.prompt < 1 or args.gen < 2 or args.repeats < 1:
        raise PeerError("--prompt must be >= 1, --gen >= 2 and --repeats >= 1")
    engines = _names(args.engines, ("llama.cpp", "ninfer"), "--engines")
    if not Path(gguf).is_file():
        raise PeerError(f"no such GGUF: {gguf}")
    model = model_dir(str(model))
    t0 = time.time()
    llama = R.llama_bench(args.bin_dir, gguf, depths, kvs, n_prompt=args.prompt, n_gen=args.gen,
                          repeats=args.repeats, ngl=args.ngl, log=R.stderr_log) if "llama.cpp" in engines else []
    args.model = str(model)
    ninfer = R.ninfer_speed(args, depths, nkvs, n_prompt=args.prompt, n_gen=args.gen, repeats=args.repeats,
                            log=R.stderr_log) if "ninfer" in engines else {}
    return {"bench": "peer-speed", "env": T.environment(args.device), "model": str(model), "gguf": str(gguf),
            "settings": {"depths": depths, "prompt": args.prompt, "gen": args.gen, "repeats": args.repeats,
                         "llama_kv": kvs, "ninfer_kv": nkvs, "ngl": args.ngl, "flash_attn": 1},
            "llama_cpp": llama, "llama_kv_bytes_per_token": kv_bytes_from_gguf(gguf, kvs),
            "ninfer": ninfer, "seconds": round(time.time() - t0, 1)}


def kv_bytes_from_gguf(gguf: Path, kvs: list[str]) -> dict[str, float] | None:
    """K + V bytes per token of llama.cpp's cache from the GGUF's geometry and ggml's block sizes (the speed run
    has no KV log line; the KL run's logged sizes check this)."""
    try:
        from gguf import GGUFReader
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return None
    f = GGUFReader(str(gguf)).fields
    arch = f["general.architecture"].contents()
    get = lambda k: f[f"{arch}.{k}"].contents() if f"{arch}.{k}" in f else None  # noqa: E731
    layers, heads, kvh = get("block_count"), get("attention.head_count"), get("attention.head_count_kv")
    emb = get("embedding_length")
    dk = get("attention.key_length") or emb // heads
    dv = get("attention.value_length") or emb // heads
    out = {}
    for kv in kvs:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kv.upper()]]
        out[kv] = layers * kvh * (dk + dv) * size / block
    return out


def kl(args: argparse.Namespace, model: str | Path, gguf: Path, work: Path) -> dict[str, Any]:
    kvs = [k for k in _names(args.kv, R.LLAMA_KV, "--kv") if k != "f16"]
    nkvs = _kv_dtypes(args.kl_kv_dtype)
    _kv_dtypes(args.reference)
    if args.ctx < 8:
        raise PeerError("--ctx must be >= 8")
    if not Path(gguf).is_file():
        raise PeerError(f"no such GGUF: {gguf}")
    text = args.text or default_text(work / "peer-text.txt")
    if not Path(text).is_file():
        raise PeerError(f"no such text file: {text}")
    model = model_dir(str(model))
    Path(work).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    llama = R.llama_kl(args.bin_dir, gguf, Path(text), work, kvs, ctx=args.ctx, ngl=args.ngl, log=R.stderr_log)
    add_bos = bool(_gguf_field(gguf, "tokenizer.ggml.add_bos_token"))
    n_ctx, _, ids = R.read_kld_tokens(Path(llama["base_file"]))  # both engines score llama.cpp's token ids
    if n_ctx != args.ctx:
        raise PeerError(f"{llama['base_file']} holds chunks of {n_ctx} tokens, not --ctx {args.ctx}")
    ours = R.ninfer_kl(str(model), ids, nkvs, ctx=args.ctx, reference=args.reference, add_bos=add_bos,
                       device=args.kl_device, log=R.stderr_log)
    ours["hf_tokens"] = _hf_token_count(model, Path(text))
    return {"bench": "peer-kl", "model": str(model), "gguf": str(gguf), "text": str(text), "ctx": args.ctx,
            "add_bos": add_bos, "llama_cpp": llama, "ninfer": ours, "seconds": round(time.time() - t0, 1)}


def _hf_token_count(model: Path, text: Path) -> int:
    """Tokens of the text by the checkpoint's HF tokenizer (recorded beside llama.cpp's count)."""
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(str(model))(text.read_text(encoding="utf-8"),
                                                          add_special_tokens=False).input_ids)


def _gguf_field(gguf: Path, key: str) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    f = GGUFReader(str(gguf)).fields.get(key)
    return f.contents() if f is not None else None


def run(args: argparse.Namespace) -> int:
    from ninfer.bench import peer_all
    use_gguf_py(getattr(args, "src", Path(".carry/llama.cpp")))
    try:
        if args.action == "prepare":
            sdist = B.download(Path("/tmp/lcpp-sdist")) if args.download else args.sdist
            n = B.prepare(sdist, args.out)
            print(f"pruned llama.cpp at {args.out}: {n / 2**20:.1f} MiB")
        elif args.action == "build":
            res = B.build(args.src, args.build_dir, backend=args.backend, arch=args.cuda_arch, jobs=args.jobs,
                          save_bin=args.save_bin, log=R.stderr_log)
            print(f"built {', '.join(B.TOOLS)} ({res['backend']}) in {res['seconds']:.0f} s with -j {res['jobs']}: "
                  f"{res['bin_dir']}")
        elif args.action == "convert":
            out = B.convert(args.src, model_dir(args.model), args.out, args.outtype, args.pre, log=R.stderr_log)
            print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
        elif args.action == "speed":
            res = speed(args, args.model, args.gguf)
            print(peer_all.speed_table(res))
            write(args.json, res)
        elif args.action == "kl":
            res = kl(args, args.model, args.gguf, args.work)
            print(peer_all.kl_table(res))
            write(args.json, res)
        else:
            return peer_all.run_all(args)
    except PeerError as e:
        print(f"ninfer bench peer {args.action}: {e}", file=sys.stderr)
        return 1
    return 0
