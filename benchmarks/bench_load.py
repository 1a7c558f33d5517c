#!/usr/bin/env python3
"""Seconds from launch to ready for a real safetensors checkpoint written to local disk.

Writes a Qwen2-architecture checkpoint of the given shape (by default Qwen2.5-7B's: hidden
3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944, vocab 152064, untied LM head,
bfloat16, 15.2 GB) in shards of at most 4 GiB with an index, small random normal values
(a pool drawn once, each tensor a slice of it) and a small byte-level BPE tokenizer, then
measures:

- the files' raw read speed: each file read once with 64 MiB ``readinto`` calls after
  asking the kernel to drop it from the page cache (``POSIX_FADV_DONTNEED``; whether that
  took shows as this rate against the second, warm read's);
- ``--launches`` launches, one after another, of ``python -m rvllm.server.app`` (seconds
  from the process's start to ``/health`` answering 200) and of a process that builds
  ``rvllm.LLM(...)`` (seconds from its start to the constructor's return, with the
  engine's ``startup_phases``). The first launch fills Triton's on-disk cache on a GPU;
  the later ones are the "cache warm" numbers. With ``--cold`` the files are dropped
  from the page cache before each launch, so loading reads the disk.

    python benchmarks/bench_load.py --device cuda --dtype bfloat16            # 7B shape
    python benchmarks/bench_load.py --device cpu --dtype bfloat16 --layers 2  # a check
        [--dir /tmp/rvllm-load] [--launches 2] [--cold] [--mode server|llm|both]
        [--json OUT.json] [--rewrite] [--engine-kwargs JSON] [-- EXTRA SERVER ARGS]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

SHARD_BYTES = 4 << 30
READ_BYTES = 64 << 20
POOL_ELEMENTS = 32 << 20  # the random values every tensor is cut from
SUFFIX = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def tensor_shapes(a: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2's tensors, in the order Hugging Face writes them."""
    head_dim = a.hidden // a.heads
    kv = a.kv_heads * head_dim
    out = [("model.embed_tokens.weight", (a.vocab, a.hidden))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (a.hidden,)),
                (p + "self_attn.q_proj.weight", (a.hidden, a.hidden)),
                (p + "self_attn.q_proj.bias", (a.hidden,)),
                (p + "self_attn.k_proj.weight", (kv, a.hidden)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, a.hidden)),
                (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (a.hidden, a.hidden)),
                (p + "post_attention_layernorm.weight", (a.hidden,)),
                (p + "mlp.gate_proj.weight", (a.intermediate, a.hidden)),
                (p + "mlp.up_proj.weight", (a.intermediate, a.hidden)),
                (p + "mlp.down_proj.weight", (a.hidden, a.intermediate))]
    return out + [("model.norm.weight", (a.hidden,)), ("lm_head.weight", (a.vocab, a.hidden))]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str,
                pools: dict[str, memoryview], seed: int) -> None:
    """One safetensors file, streamed: the header, then each tensor's bytes from the pool
    (norms from the pool of ones), starting at a place that differs per tensor."""
    import numpy as np

    size = {"BF16": 2, "F16": 2, "F32": 4}[SUFFIX[dtype]]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * size
        header[name] = {"dtype": SUFFIX[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in tensors:
            pool = pools["ones" if name.endswith("norm.weight") else "random"]
            left = _numel(shape) * size
            at = int(rng.integers(0, len(pool) // size)) * size
            while left:
                n = min(left, len(pool) - at)
                f.write(pool[at:at + n])
                left -= n
                at = 0
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(a: argparse.Namespace, out: Path) -> list[Path]:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    dt = getattr(torch, a.ckpt_dtype)
    gen = torch.Generator().manual_seed(0)
    pools = {"random": (torch.randn(POOL_ELEMENTS, generator=gen) * 0.02).to(dt),
             "ones": torch.ones(max(a.hidden, 1 << 16), dtype=dt)}
    views = {k: memoryview(v.view(torch.uint8).numpy()) for k, v in pools.items()}
    shapes = tensor_shapes(a)
    size = torch.empty((), dtype=dt).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in shapes:
        nbytes = _numel(shape) * size
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    files, weight_map = [], {}
    for i, tensors in enumerate(shards):
        file = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(file, tensors, a.ckpt_dtype, views, seed=i)
        files.append(file)
        weight_map.update({name: file.name for name, _ in tensors})
    total = sum(_numel(s) for _, s in shapes) * size
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
        vocab_size=a.vocab, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False,
        torch_dtype=a.ckpt_dtype, bos_token_id=0, eos_token_id=1, use_sliding_window=False)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out)
    return files


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([Path(__file__).read_text(encoding="utf-8")], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                            eos_token="<|im_end|>").save_pretrained(out)


def drop_from_page_cache(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(files: list[Path]) -> float:
    """GB/s of reading the files once, in 64 MiB reads."""
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total / (time.perf_counter() - start) / 1e9


def filesystem(path: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fs = line.split()[:3]
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(a: argparse.Namespace, extra: list[str]) -> float:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "rvllm.server.app", "--model", str(a.dir), "--port",
           str(port), "--device", a.device, "--dtype", a.dtype, "--max-model-len",
           str(a.max_model_len), "--disable-uvicorn-access-log", *extra]
    log = open(a.dir / f"server-{port}.log", "wb")  # noqa: SIM115 - closed below
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > a.timeout:
                raise TimeoutError(f"not healthy in {a.timeout} s; see {log.name}")
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def launch_llm(a: argparse.Namespace) -> tuple[float, dict[str, float]]:
    cmd = [sys.executable, __file__, "--child-llm", "--dir", str(a.dir), "--device", a.device,
           "--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--engine-kwargs",
           a.engine_kwargs]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    phases: dict[str, float] = {}
    ready = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            ready = time.perf_counter() - start
            phases = json.loads(line[6:])
    if proc.wait() != 0 or ready is None:
        raise RuntimeError(f"the LLM process failed ({proc.returncode})")
    return ready, phases


def child_llm(a: argparse.Namespace) -> None:
    """Build the engine and say so on stdout (with its phases), as a fresh process."""
    from rvllm import LLM

    kwargs = json.loads(a.engine_kwargs)
    llm = LLM(str(a.dir), device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
              **kwargs)
    engine = llm.engine
    phases = {k: round(v, 3) for k, v in engine.startup_phases.items()}
    phases["load_model"] = round(engine.model.load_seconds, 3)
    print("READY " + json.dumps(phases), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/rvllm-load"))
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=18944)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--ckpt-dtype", default="bfloat16", choices=sorted(SUFFIX))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--mode", default="both", choices=["server", "llm", "both"])
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before each launch")
    parser.add_argument("--rewrite", action="store_true",
                        help="write the checkpoint even if --dir holds one")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--engine-kwargs", default="{}",
                        help="JSON of further rvllm.LLM arguments (the server's come after --)")
    parser.add_argument("--child-llm", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.child_llm:
        child_llm(a)
        return
    result: dict[str, object] = {"shape": {k: getattr(a, k) for k in (
        "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "ckpt_dtype")},
        "device": a.device, "dtype": a.dtype, "cold": a.cold, "dir": str(a.dir),
        "filesystem": filesystem(a.dir.parent if not a.dir.exists() else a.dir)}
    config = a.dir / "config.json"
    if a.rewrite or not config.is_file() or json.loads(config.read_text()).get(
            "num_hidden_layers") != a.layers:
        start = time.perf_counter()
        write_checkpoint(a, a.dir)
        result["write_s"] = round(time.perf_counter() - start, 2)
    files = sorted(a.dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    result["checkpoint_gb"] = round(size / 1e9, 3)
    drop_from_page_cache(files)
    result["read_gbps_after_drop"] = round(read_rate(files), 2)
    result["read_gbps_warm"] = round(read_rate(files), 2)
    print(json.dumps(result), flush=True)
    modes = ["server", "llm"] if a.mode == "both" else [a.mode]
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if "server" in modes and missing:
        if a.mode == "server":
            raise SystemExit(f"the server needs {', '.join(missing)}")
        modes.remove("server")
        result["server_skipped"] = f"not installed: {', '.join(missing)}"
        print(json.dumps({"server_skipped": result["server_skipped"]}), flush=True)
    launches: list[dict[str, object]] = []
    for i in range(a.launches):
        for mode in modes:
            if a.cold:
                drop_from_page_cache(files)
            row: dict[str, object] = {"launch": i + 1, "mode": mode}
            if mode == "server":
                row["launch_to_health_s"] = round(launch_server(a, extra), 2)
            else:
                seconds, phases = launch_llm(a)
                row["launch_to_ready_s"] = round(seconds, 2)
                row["startup_phases_s"] = phases
                load = phases.get("load_model")
                if load:
                    row["load_gbps"] = round(size / load / 1e9, 2)
            print(json.dumps(row), flush=True)
            launches.append(row)
    result["launches"] = launches
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
