"""``python -m tools.static_report``: what the kernels cost in registers, spills and shared memory, without a GPU.

Each Triton launch fold would make for a shape is recorded by running the real launcher on ``meta``
tensors inside ``fold.kernels.launch.recorded()`` (the door every launch of fold goes through, so the
arguments, constexprs and launch options are exactly the launcher's), then compiled for a target
(default ``sm_90``, the H200) with Triton's public compiler (``triton.compile`` of an ``ASTSource``,
specialised as Triton's JIT specialises a launch) and the ``ptxas``/``cuobjdump``/``nvdisasm`` shipped
in the triton wheel:

- ``registers``: ``REG`` from ``cuobjdump -res-usage``;
- ``spill_stores`` / ``spill_loads``: ``STL`` / ``LDL`` instructions in the SASS (local memory is
  only used for spills in these kernels: they have no local arrays);
- ``shared_bytes``: ``SHARED`` from ``cuobjdump -res-usage`` (static + what Triton requests);
- ``wgmma``: ``HGMMA`` instructions (Hopper's warpgroup MMA) in the SASS;
- ``fp64``: float64 arithmetic (``DFMA``/``DMUL``/``DADD``/``DSETP``/``DMNMX``) in the SASS: the kernels
  form rotation angles in float64 and nothing else, so a loop that rotates nothing (the far loop over
  un-rotated keys) holds none.

Compilation needs no GPU but must run with ``TRITON_INTERPRET`` unset (an interpreted kernel has
no compiler); :func:`inspect_in_subprocess` runs the report in a clean child process for callers
that are themselves under the interpreter (the test session).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

from fold.argtypes import positive
from fold.config_lookup import SHARED_BYTES_PER_SM, SHARED_RESERVED_PER_CTA
from fold.kernels.launch import Launch, recorded

H200_SMS = 132
TRITON_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Inside the block, every launch of fold's launchers is recorded instead of run (no device needed)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the static report compiles kernels; run it with TRITON_INTERPRET unset "
                           "(see inspect_in_subprocess)")
    with recorded() as seen:
        yield seen


def _specialised(kernel, backend, bound_args: dict, specialization: list) -> tuple[dict, dict, dict]:
    """What Triton's JIT derives from a launch's specialisation before it compiles: the signature
    ``{parameter: type}``, the constexprs ``{(index,): value}`` and the attributes ``{(index,): [...]}``
    (16-byte alignment, ints equal to 1). fold's kernels take no tuple parameters."""
    values = list(bound_args.values())
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, (kind, attr)) in enumerate(zip(kernel.params, specialization)):
        if isinstance(kind, tuple):
            raise ValueError(f"{kernel.fn.__name__}: tuple parameter {param.name} is not supported")
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)], attr = values[i], ""
        if isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def compile_launch(launch: Launch, arch: int = 90):
    """Compile a recorded launch for ``sm_<arch>`` as Triton would at that launch (same signature,
    specialisation on 16-byte alignment and on ints equal to 1, constexprs and options)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    # the options a launch adds, so that a compile here is a cache hit for a later launch
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    bound_args, specialization, _ = binder(*launch.args, **kwargs)
    signature, constexprs, attrs = _specialised(kernel, backend, bound_args, specialization)
    options = backend.parse_options(kwargs)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _tool(name: str, *args: str) -> str:
    return subprocess.run([str(TRITON_BIN / name), *args], check=True, capture_output=True, text=True).stdout


FP64_OPS = frozenset({"DFMA", "DMUL", "DADD", "DSETP", "DMNMX"})


def cubin_resources(cubin: bytes) -> dict:
    """Registers, shared bytes, spill stores/loads, wgmma and float64 instruction counts of one cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = _tool("cuobjdump", "-res-usage", str(path))
        sass = _tool("nvdisasm", "-c", str(path))
    regs = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    opcodes = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, flags=re.M)
    return dict(
        registers=int(regs.group(1)) if regs else None,
        shared_bytes=int(shared.group(1)) if shared else None,
        spill_stores=sum(op == "STL" for op in opcodes),
        spill_loads=sum(op == "LDL" for op in opcodes),
        wgmma=sum(op == "HGMMA" for op in opcodes),
        fp64=sum(op in FP64_OPS for op in opcodes),
        instructions=len(opcodes),
    )


# --- what fold launches for the drafter shapes ------------------------------------------------------------

DEFAULT_LENGTHS = (8192, 32768, 131072, 262144)
# KV heads of each drafter shape (its query heads kept): MQA/GQA drafters with one or two KV heads at
# batch 1 are where the split model picks the most splits, so stage 2 merges the most states
DEFAULT_HEADS_KV = (1, 2, 4, 8)
TREE_NODES = 16
SERVE_PAGE = 16          # vLLM's CUDA block size
# the reads fold.vllm serves besides FOLD itself (un-rotated keys, as its cache holds them, rotated queries,
# a paged cache), each a variant of the launches: name -> fold_attention_fwd options (sliding windows: Gemma-style 512)
SERVING = {
    "serve-fold": dict(),
    "serve-window": dict(read_far=False),
    "serve-sliding": dict(sliding_window=512, causal=True),
    "serve-fp8": dict(k_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5),
    # a budgeted far read (fold.far_pages): the far launch over a page list, 1024 entries in vLLM's pages
    "serve-budget": dict(far_budget=1024),
    # a soft-capped drafter layer (Gemma-style attention logit capping)
    "serve-softcap": dict(softcap=50.0),
}
# the budgeted far read of a contiguous cache: far_budget entries in pages of FAR_PAGE (the API's default)
FAR_BUDGET, FAR_PAGE = 1024, 64


@dataclasses.dataclass
class Item:
    """One launch of the report: which read it belongs to and the recorded launch."""

    kernel: str
    shape: str
    heads_kv: int
    length: int
    keys_rotated: bool
    config: dict
    launch: Launch
    read: str = "fold"


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def fold_launches(shape, length: int, keys_rotated: bool, config, *, batch: int = 1,
                  dtype=torch.bfloat16, seqlens=None, page_size: int = 0, k_dtype=None, far_budget=None,
                  **options) -> list[Launch]:
    """The launches of one ``fold.attention`` read of a ``DrafterShape`` with ``config`` (from a
    paged cache with ``page_size``, which implies cache_seqlens; a cache in ``k_dtype``, default q's;
    a budgeted far read of ``far_budget`` entries in pages of ``page_size`` or :data:`FAR_PAGE`);
    ``options`` go to the launcher (``read_far``, ``sliding_window``, ``causal``, ``queries_rotated``,
    ``k_scale``, ``v_scale``)."""
    from fold.kernels.fold_attention import fold_attention_fwd

    q = _meta(batch, shape.n_q, shape.heads_q, shape.head_dim, dtype=dtype)
    k_dtype = k_dtype or dtype
    paged = {}
    if page_size:
        blocks = -(-length // page_size)
        k = _meta(batch * blocks, page_size, shape.heads_kv, shape.head_dim, dtype=k_dtype)
        paged = dict(block_table=_meta(batch, blocks, dtype=torch.int32))
        seqlens = _meta(batch, dtype=torch.int32)
    else:
        k = _meta(batch, length, shape.heads_kv, shape.head_dim, dtype=k_dtype)
    inv_freq = _meta(shape.head_dim // 2, dtype=torch.float32)
    if far_budget is not None:
        far_page = page_size or FAR_PAGE
        options.update(far_page=far_page,
                       far_pages=_meta(batch, shape.heads_kv, far_budget // far_page, dtype=torch.int32))
    with record_launches() as seen:
        fold_attention_fwd(q, k, k, inv_freq, seqlens, window=shape.window, alpha=2.0,
                           softmax_scale=shape.head_dim ** -0.5, rotary_dim=shape.head_dim, interleaved=False,
                           attention_factor=1.0, keys_rotated=keys_rotated, return_lse=True, config=config, **paged,
                           **options)
    return seen


def tree_launches(shape, length: int, config, *, n_tree: int = TREE_NODES, batch: int = 1,
                  dtype=torch.bfloat16, seqlens=None) -> list[Launch]:
    """The launches of one ``fold.tree_attention`` read (its cached read, then the tree kernel)."""
    from fold.kernels.tree_attention import tree_attention_fwd

    q = _meta(batch, n_tree, shape.heads_q, shape.head_dim, dtype=dtype)
    k = _meta(batch, length, shape.heads_kv, shape.head_dim, dtype=dtype)
    kt = _meta(batch, n_tree, shape.heads_kv, shape.head_dim, dtype=dtype)
    mask = torch.empty(batch, n_tree, n_tree, dtype=torch.bool, device="meta")
    with record_launches() as seen:
        tree_attention_fwd(q, k, k, kt, kt, mask, seqlens, softmax_scale=shape.head_dim ** -0.5, return_lse=True,
                           config=config)
    return seen


def launched_config(shape, length: int, keys_rotated: bool, *, n_q: int | None = None, device: str = "NVIDIA_H200",
                    sms: int = H200_SMS, dtype=torch.bfloat16):
    """The stage-1 config fold would launch on ``device`` (its shipped cache entry, else the
    heuristic) with ``sms`` SMs, for batch 1."""
    from fold.config_lookup import config_for

    q = _meta(1, n_q or shape.n_q, shape.heads_q, shape.head_dim, dtype=dtype)
    k = _meta(1, length, shape.heads_kv, shape.head_dim, dtype=dtype)
    return config_for(q, k, keys_rotated, device=device, sms=sms)


def _kernel_name(launch: Launch) -> str:
    if launch.name == "fold_fwd_kernel_stage1":
        kw = launch.kwargs
        far = "far-pages" if kw.get("FAR_PAGE") else "far"
        return f"stage1[{'plain' if kw['PLAIN'] else 'window' if kw['IS_WINDOW'] else far}]"
    return launch.name.removeprefix("fold_fwd_kernel_")


def _launch_config(launch: Launch) -> dict:
    """The launch's tile and grid: for stage 1 the branch's own BLOCK_N and split count."""
    kw = launch.kwargs
    if launch.name == "fold_fwd_kernel_stage1":
        return dict(block_m=kw["BLOCK_M"], block_n=kw["BLOCK_N"], num_splits=launch.grid[1],
                    num_warps=kw["num_warps"], num_stages=kw["num_stages"], rotate=kw["ROTATE"])
    out = {k.lower(): v for k, v in kw.items() if k in ("BLOCK_M", "BLOCK_S", "BLOCK_T", "ROT_BLOCK_N")}
    out["num_warps"] = kw.get("num_warps", 4)
    return out


def plan(drafters=None, lengths=DEFAULT_LENGTHS, layouts=(False, True), *, heads_kv=DEFAULT_HEADS_KV,
         tree: bool = True, device: str = "NVIDIA_H200", sms: int = H200_SMS, page_size: int = 0,
         serving: bool = True) -> list[Item]:
    """Every launch fold makes on ``device`` at batch 1 for the drafter shapes, each with every
    count of KV heads in ``heads_kv`` (``None``: the shape's own) x key layouts x lengths (the fused
    read: prologue, stage 1, stage 2), for ``fold.tree_attention`` with :data:`TREE_NODES` nodes
    at each length (its cached read and the tree kernel), and with ``serving`` the reads of
    :data:`SERVING` as ``fold.vllm`` launches them (the shape's own KV heads, rotated queries, un-rotated
    keys, pages of :data:`SERVE_PAGE`)."""
    from benchmarks.workloads import DRAFTERS

    items = []
    for name in drafters or DRAFTERS:
        for kv in heads_kv or (DRAFTERS[name].heads_kv,):
            if DRAFTERS[name].heads_q % kv:
                raise ValueError(f"{name} has {DRAFTERS[name].heads_q} query heads: {kv} KV heads do not divide them")
            shape = dataclasses.replace(DRAFTERS[name], heads_kv=kv)
            for length in lengths:
                for keys_rotated in layouts:
                    config = launched_config(shape, length, keys_rotated, device=device, sms=sms)
                    for launch in fold_launches(shape, length, keys_rotated, config, page_size=page_size):
                        items.append(Item(_kernel_name(launch), name, kv, length, keys_rotated,
                                          _launch_config(launch), launch))
                    for launch in fold_launches(shape, length, keys_rotated, config, page_size=page_size,
                                                far_budget=FAR_BUDGET):
                        if launch.kwargs.get("FAR_PAGE"):   # the other launches are the full read's
                            items.append(Item(_kernel_name(launch), name, kv, length, keys_rotated,
                                              _launch_config(launch), launch, "fold-budget"))
                if tree:
                    config = launched_config(shape, length, True, n_q=TREE_NODES, device=device, sms=sms)
                    for launch in tree_launches(shape, length, config):
                        kernel = launch.name if launch.name == "tree_fwd_kernel" else f"tree/{_kernel_name(launch)}"
                        items.append(Item(kernel, name, kv, length, True, _launch_config(launch), launch))
        if not serving:
            continue
        shape = DRAFTERS[name]
        for length in lengths:
            config = launched_config(shape, length, False, device=device, sms=sms)
            for read, options in SERVING.items():
                for launch in fold_launches(shape, length, False, config, page_size=SERVE_PAGE, queries_rotated=True,
                                            **options):
                    items.append(Item(_kernel_name(launch), name, shape.heads_kv, length, False,
                                      _launch_config(launch), launch, read))
    return items


def report(items: list[Item], *, arch: int = 90, dump: Path | None = None, workers: int | None = None,
            log: Callable[[str], None] | None = None) -> list[dict]:
    """Compile every item for ``sm_<arch>`` (each distinct kernel once, ``workers`` at a time) and
    return one record per item; with ``dump``, write each cubin there under its record's name."""
    from concurrent.futures import ThreadPoolExecutor

    def work(item):
        compiled = compile_launch(item.launch, arch)
        return compiled.hash, compiled.asm["cubin"], compiled.metadata.shared

    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        compiled = list(pool.map(work, items))
    resources: dict[str, dict] = {}
    records = []
    for item, (digest, cubin, shared) in zip(items, compiled):
        name = f"{item.launch.name}-{digest[:12]}.cubin"      # one file per distinct compiled kernel
        if digest not in resources:
            resources[digest] = cubin_resources(cubin)
            if dump is not None:
                Path(dump).mkdir(parents=True, exist_ok=True)
                (Path(dump) / name).write_bytes(cubin)
        res = resources[digest]
        records.append(dict(kernel=item.kernel, read=item.read, shape=item.shape, heads_kv=item.heads_kv,
                            length=item.length,
                            keys_rotated=item.keys_rotated, config=item.config, arch=f"sm_{arch}",
                            registers=res["registers"], spill_stores=res["spill_stores"],
                            spill_loads=res["spill_loads"], shared_bytes=shared, wgmma=res["wgmma"],
                            fp64=res["fp64"],
                            ctas_per_sm=ctas_per_sm(res["registers"], item.config["num_warps"], shared),
                            cubin=name))
        if log:
            log(format_row(records[-1]))
    return records


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int, *,
                shared_per_sm: int = SHARED_BYTES_PER_SM) -> int:
    """CTAs of a kernel one Hopper SM holds at once, by registers (allocated per warp in units of
    256) and shared memory (plus the reservation per CTA)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (per_warp * num_warps)
    by_shared = shared_per_sm // (shared_bytes + SHARED_RESERVED_PER_CTA)
    return min(by_registers, by_shared, 32)


def stage1_spills(shape, keys_rotated: bool, tiles, *, arch: int = 90, length: int = 32768,
                  workers: int | None = None) -> dict:
    """``{tile: spill stores + loads}`` of the stage-1 kernels (window and far launches) of each
    tile for a drafter shape; 0 means usable. Compiles in parallel, records launches first."""
    from concurrent.futures import ThreadPoolExecutor

    from fold.kernels.fold_attention import FoldConfig

    launches = {tile: [x for x in fold_launches(shape, length, keys_rotated, FoldConfig(tile[0], tile[1], 4, *tile[2:]))
                       if x.name == "fold_fwd_kernel_stage1"] for tile in tiles}

    def count(launch):
        res = cubin_resources(compile_launch(launch, arch).asm["cubin"])
        return res["spill_stores"] + res["spill_loads"]

    flat = [(tile, launch) for tile, group in launches.items() for launch in group]
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        counts = list(pool.map(lambda pair: count(pair[1]), flat))
    out = dict.fromkeys(launches, 0)
    for (tile, _), n in zip(flat, counts):
        out[tile] += n
    return out


HEADER = (f"{'shape':<12} {'read':<13} {'Hkv':>3} {'layout':<9} {'L':>7} {'kernel':<22} {'config':<34} {'regs':>4} "
          f"{'spill st/ld':>11} {'smem KB':>7} {'wgmma':>5} {'fp64':>5} {'CTA/SM':>6}")


def format_row(r: dict) -> str:
    c = r["config"]
    if "num_splits" in c:
        config = (f"m{c['block_m']} n{c['block_n']} s{c['num_splits']} w{c['num_warps']} st{c['num_stages']}"
                  f"{' rotate' if c['rotate'] else ''}")
    else:
        config = " ".join(f"{k}={v}" for k, v in c.items())
    layout = "rotated" if r["keys_rotated"] else "unrotated"
    return (f"{r['shape']:<12} {r.get('read', 'fold'):<13} {r['heads_kv']:>3} {layout:<9} {r['length']:>7} "
            f"{r['kernel']:<22} {config:<34} {r['registers']:>4} "
            f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>11} {r['shared_bytes'] / 1024:>7.1f} "
            f"{r['wgmma']:>5} {r['fp64']:>5} {r['ctas_per_sm']:>6}")


ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    """This process's environment without ``TRITON_INTERPRET``, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def inspect_in_subprocess(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``python -m tools.static_report ARGS`` in a child without ``TRITON_INTERPRET`` (for callers,
    such as the test session, whose kernels are interpreted)."""
    return subprocess.run([sys.executable, "-m", "tools.static_report", *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=ROOT)


def compile_read(spec: dict) -> list[dict]:
    """Compile (into Triton's cache) every kernel of one read described by ``spec`` (plain values,
    so a process pool can take it): ``kind`` ("fold" or "tree"), ``n_q``, ``heads_q``, ``heads_kv``,
    ``head_dim``, ``window``, ``length``, ``keys_rotated``, ``tile``, ``splits``, ``dtype`` (a name),
    ``seqlens`` (whether cache_seqlens is passed), ``batch``, ``arch``. Returns one
    ``{kernel, registers, spill_stores, spill_loads}`` per launch."""
    from fold.kernels.fold_attention import FoldConfig
    from benchmarks.workloads import DrafterShape

    dtype = getattr(torch, spec["dtype"])
    shape = DrafterShape("spec", n_q=spec["n_q"], heads_q=spec["heads_q"], heads_kv=spec["heads_kv"],
                         head_dim=spec["head_dim"], window=spec["window"])
    tile = spec["tile"]
    config = FoldConfig(tile[0], tile[1], spec["splits"], tile[2], tile[3])
    batch = spec["batch"]
    seqlens = _meta(batch, dtype=torch.int32) if spec["seqlens"] else None
    if spec["kind"] == "tree":
        launches = tree_launches(shape, spec["length"], config, n_tree=spec["n_q"], batch=batch, dtype=dtype,
                                 seqlens=seqlens)
    else:
        launches = fold_launches(shape, spec["length"], spec["keys_rotated"], config, batch=batch, dtype=dtype,
                                 seqlens=seqlens)
    out = []
    for launch in launches:
        res = cubin_resources(compile_launch(launch, spec["arch"]).asm["cubin"])
        out.append(dict(kernel=_kernel_name(launch), registers=res["registers"], spill_stores=res["spill_stores"],
                        spill_loads=res["spill_loads"]))
    return out


# --- the command line ---------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    from benchmarks.workloads import DRAFTERS

    p = argparse.ArgumentParser(prog="python -m tools.static_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=sorted(DRAFTERS))
    p.add_argument("--layout", nargs="+", default=["unrotated", "rotated"], choices=["unrotated", "rotated"])
    p.add_argument("--lengths", nargs="+", type=positive(int), default=None,
                   help="cache lengths (default: 8K, 32K, 128K, 256K)")
    p.add_argument("--heads-kv", nargs="+", type=positive(int), default=None,
                   help="KV heads of each drafter shape, its query heads kept (default: 1 2 4 8)")
    p.add_argument("--device", default="NVIDIA_H200", help="the cache file name fold would read")
    p.add_argument("--sms", type=positive(int), default=132, help="SMs the split model assumes")
    p.add_argument("--arch", type=positive(int), default=90, help="compile for sm_<arch>")
    p.add_argument("--no-tree", action="store_true", help="leave out fold.tree_attention's launches")
    p.add_argument("--no-serving", action="store_true",
                   help="leave out the reads fold.vllm serves (window alone, sliding + causal, FP8 pages)")
    p.add_argument("--page-size", type=positive(int), default=None,
                   help="read a paged cache (block_table) with pages of this many entries")
    p.add_argument("--json", action="store_true", help="print one JSON list, one object per launch")
    p.add_argument("--dump", type=Path, default=None, help="write each cubin into this folder")
    p.add_argument("--workers", type=positive(int), default=None, help="parallel compiles")
    return p


def main(argv=None) -> int:
    """Compile what fold launches and print the table (or ``--json``); 1 if anything spills."""
    args = parser().parse_args(argv)
    name = "python -m tools.static_report"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(f"{name}: error: TRITON_INTERPRET=1 is set; the report compiles the kernels, "
              "run it without the interpreter", file=sys.stderr)
        return 2
    try:
        items = plan(args.drafters, args.lengths or DEFAULT_LENGTHS, tuple(x == "rotated" for x in args.layout),
                     heads_kv=args.heads_kv or DEFAULT_HEADS_KV, tree=not args.no_tree, device=args.device,
                     sms=args.sms, page_size=args.page_size or 0, serving=not args.no_serving)
    except ValueError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"what fold launches on {args.device} ({args.sms} SMs), compiled for sm_{args.arch}\n")
        print(HEADER)
    records = report(items, arch=args.arch, dump=args.dump, workers=args.workers, log=None if args.json else print)
    if args.json:
        print(json.dumps(records, indent=1))
    spilling = [r for r in records if r["spill_stores"] or r["spill_loads"]]
    for r in spilling:
        print(f"{name}: spills: {format_row(r)}", file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
