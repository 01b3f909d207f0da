"""vLLM 0.34's V2 ``DFlashSpeculator`` driven directly on a CPU, as ``GPUModelRunner`` drives it.

No engine runs: the test builds the ``VllmConfig`` (``EngineArgs``, enforce_eager, no custom ops),
loads the target through vLLM (only its embedding and LM head serve: the drafter shares them),
constructs the speculator, builds the KV-cache config, block tables and attention groups as
``GPUModelRunner.initialize_kv_cache`` does, and calls ``propose`` for a prefill and then for verify
steps with chosen rejections. The target's side of each step (its hidden states at the drafter's
``target_layer_ids``, its greedy bonus token) comes from a transformers forward of the same target.
:class:`PlainDFlash` is the same drafter in float64 plain PyTorch, to check the drafts against.

The CUDA build of vLLM runs here on ``UnspecifiedPlatform`` with every Triton kernel on the path in
Triton's interpreter (``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=""``, set by this folder's
conftest before vLLM is imported). :func:`patched` holds what that needs (:data:`WORKAROUNDS` says
why each); nothing of vLLM or fold is edited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import random
import socket
from pathlib import Path

import numpy as np
import torch

import fold
import fold.vllm
from fold.vllm.backend import FAR_POSITION, FoldAttentionImpl, cache_pages
from reference import fold_attention_ref
from reference.tolerance import check_close
from tests.helpers import Recorder, dense_cache  # noqa: F401 (Recorder: the tests import it from here)
from tests.vllm.pair import make_drafter, make_target

K = 3                       # num_speculative_tokens: blocks of 1 + K query rows
BLOCK = 16                  # the cache's block size (tokens per page)
SMALL_W = 8                 # a fold window shorter than every context: most entries are far memory
# the short schedule the speculator, FP8 and TP tests share: a prefill of two requests, then verifies
# rejecting some, all and none of the drafts
SHORT_PROMPTS = {0: list(range(3, 30)), 1: [5 + (7 * i) % 200 for i in range(14)]}
SHORT_SCHEDULE = [
    [(0, SHORT_PROMPTS[0]), (1, SHORT_PROMPTS[1])],
    [(0, 1), (1, K)],
    [(0, 0), (1, 2)],
]
STOCK_BACKEND = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"

WORKAROUNDS = {
    "env": 'CUDA_VISIBLE_DEVICES="" and TRITON_INTERPRET=1 before vLLM is imported (conftest): vllm.triton_utils '
           "keeps HAS_TRITON with zero active drivers only under an empty CUDA_VISIBLE_DEVICES (else every kernel is "
           "a placeholder), and without the interpreter Triton stops at '0 active drivers'",
    "device_type": 'UnspecifiedPlatform.device_type/device_name = "cpu": DeviceConfig cannot infer an empty one',
    "pin_memory": "UnspecifiedPlatform.is_pin_memory_available -> False (and vllm.utils.platform_utils' cached "
                  "is_pin_memory_available / is_uva_available cleared): V2's staged block-table buffers pin host "
                  "memory, which needs a CUDA driver",
    "attn_backend": "UnspecifiedPlatform.get_attn_backend_cls -> TritonAttentionBackend: it returns '' and the "
                    "selector raises; the drafter's stock layers (fold swaps their impl) and the target's need one",
    "capability": "torch.cuda.get_device_capability -> (9, 0): the stock Triton KV write picks its tile by it "
                  "(only the stock drafter's run reaches it; fold writes its cache in torch)",
    "custom_ops": "vllm._custom_ops.rms_norm / rotary_embedding -> torch: DFlash's context K/V precompute calls "
                  "torch.ops._C directly, and this wheel's _C does not load without CUDA",
    "online_quant": "model_loader.base_loader._get_online_quantization_config -> None without a quant config: its "
                    "import chain needs compressed_tensors, which the venv lacks",
    "config": "compilation_config custom_ops=['none'] and enforce_eager=True (config, not a patch): custom ops "
              "would dispatch to forward_cuda",
    "target_layers": "Speculator(drop_target_layers=True), the Gemma-4 DSpark run only: the target's layers leave "
                     "the forward context before the drafter loads, since Gemma4DSparkModel names its layers "
                     "model.layers.<i> (no offset), as the tiny Qwen3 target does (Attention raises 'Duplicate layer "
                     "name'); a Gemma-4 target's are language_model.model.layers.<i>, and the target never runs "
                     "through vLLM in the harness",
}


# --- the process-level setup -----------------------------------------------------------------------------

def _rms_norm(out, x, weight, eps):
    """``torch.ops._C.rms_norm``: a ``[hidden]`` weight, or a ``[L, hidden]`` one selected by x's first index."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        if w.dim() == 2:
            w = w.view(w.shape[0], *([1] * (x.dim() - 2)), w.shape[1])
        y = y * w
    out.copy_(y.to(out.dtype))


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    """``torch.ops._C.rotary_embedding`` (in place on query, and key unless None) by vLLM's own native path."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    assert rope_dim_offset == 0 and not inverse, "not on the DFlash path"
    q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, cos_sin_cache.shape[-1], cos_sin_cache,
                                          is_neox)
    query.copy_(q)
    if key is not None:
        key.copy_(k)


@contextlib.contextmanager
def patched(omit=()):
    """Every attribute :data:`WORKAROUNDS` names set for the duration, then restored (``omit``: keys of
    :data:`WORKAROUNDS` to leave out, to see what each is for)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.model_loader import base_loader
    from vllm.platforms import interface
    from vllm.utils import platform_utils

    platform = interface.UnspecifiedPlatform
    online = base_loader._get_online_quantization_config
    values = [
        ("device_type", platform, "device_type", "cpu"), ("device_type", platform, "device_name", "cpu"),
        ("pin_memory", platform, "is_pin_memory_available", classmethod(lambda cls: False)),
        ("attn_backend", platform, "get_attn_backend_cls", classmethod(lambda cls, *args, **kwargs: STOCK_BACKEND)),
        ("capability", torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0)),
        ("custom_ops", ops, "rms_norm", _rms_norm), ("custom_ops", ops, "rotary_embedding", _rotary_embedding),
        ("online_quant", base_loader, "_get_online_quantization_config",
         lambda vllm_config: None if vllm_config.quant_config is None else online(vllm_config)),
    ]
    values = [(owner, name, value) for key, owner, name, value in values if key not in omit]
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in values]
    cached = (platform_utils.is_pin_memory_available, platform_utils.is_uva_available)   # functools.cache'd
    try:
        for owner, name, value in values:
            setattr(owner, name, value)
        for fn in cached:
            fn.cache_clear()
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        for fn in cached:
            fn.cache_clear()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def distributed(world_size=1, rank=0, port=None):
    """A gloo world of ``world_size`` ranks (this process ``rank``) with tensor parallel ``world_size``,
    pipeline 1 (what get_model, the parallel layers and CudaGraphManager's get_pp_group need), torn
    down afterwards; ``port``: the rendezvous, shared by the ranks (a free one for one rank)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    port = free_port() if port is None else port
    with set_current_vllm_config(VllmConfig()):       # initialize_model_parallel reads the parallel config
        ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.ensure_model_parallel_initialized(world_size, 1, backend="gloo")
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


# --- the pair on disk -------------------------------------------------------------------------------------

def make_pair(root: Path) -> dict:
    """The tiny random target (Qwen3, head_dim 64, float32) and z-lab DFlash drafter of tests/vllm/pair.py;
    ``fold.vllm.configure`` adds the ``fold`` blocks (:func:`with_block`)."""
    root = Path(root)
    return dict(root=root, target=make_target(root / "target", shift=0.0), drafter=make_drafter(root / "drafter"))


def with_block(pair: dict, name: str, **block) -> Path:
    """The pair's drafter with a ``fold`` block (``backend="torch"`` unless given), in its own folder."""
    block.setdefault("backend", "torch")
    return fold.vllm.configure(pair["drafter"], pair["root"] / name, **block)


def fold_pair(v2_process, folder: Path) -> dict:
    """``v2_process``'s tiny pair in ``folder``, plus ``"fold"``: its drafter reading ``"fold"`` with a
    window of :data:`SMALL_W` and alpha 2."""
    pair = v2_process.make_pair(folder)
    pair["fold"] = with_block(pair, "drafter-fold", read="fold", window=SMALL_W, alpha=2.0)
    return pair


# --- the speculator, set up as GPUModelRunner does ----------------------------------------------------------

def engine_config(target: Path, drafter: Path, *, k=K, max_model_len=256, num_blocks=64, max_num_seqs=4,
                  dtype="float32", method="dflash", tp=1, engine=None, **speculative):
    """The engine's config for the pair (``method``: vLLM's speculative method, ``tp``: the tensor-parallel
    size, ``engine``: more ``EngineArgs`` fields, ``speculative``: more ``speculative_config`` fields, e.g.
    ``kv_cache_dtype``)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(target), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                      skip_tokenizer_init=True, seed=0, block_size=BLOCK, num_gpu_blocks_override=num_blocks,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=512, tensor_parallel_size=tp,
                      compilation_config={"custom_ops": ["none"]}, **(engine or {}),
                      speculative_config={"method": method, "model": str(drafter), "num_speculative_tokens": k,
                                          **speculative})
    return args.create_engine_config()


class Speculator:
    """One V2 speculator (the class vLLM's ``init_speculator`` picks for the drafter: ``DFlashSpeculator``
    or a subclass, DSpark, XPress, DFlash 2, LiLiCorr) with its own config, target, KV cache and block
    tables (CPU); ``method`` and ``speculative`` as :func:`engine_config` takes them; ``drop_target_layers``:
    :data:`WORKAROUNDS` ``["target_layers"]``."""

    def __init__(self, target: Path, drafter: Path, *, k=K, max_model_len=256, num_blocks=64, max_num_seqs=4,
                 dtype="float32", method="dflash", drop_target_layers=False, **speculative):
        from vllm.config import set_current_vllm_config
        from vllm.config.compilation import CUDAGraphMode
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.model_loader import get_model
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_kv_cache
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.spec_decode import init_speculator

        self.k, self.device = k, torch.device("cpu")
        self.config = config = engine_config(target, drafter, k=k, max_model_len=max_model_len,
                                             num_blocks=num_blocks, max_num_seqs=max_num_seqs, dtype=dtype,
                                             method=method, **speculative)
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        with set_current_vllm_config(config):
            # GPUModelRunner.load_model: the target, then the speculator on it (embedding and LM head shared)
            self.target = get_model(vllm_config=config)
            if drop_target_layers:            # WORKAROUNDS["target_layers"]: the target never runs through vLLM here
                config.compilation_config.static_forward_context.clear()
            self.spec = spec = init_speculator(config, self.device, None)       # as the runner picks it
            spec.load_model(self.target)
            # initialize_kv_cache: the layout the engine core resolves, the draft layers' specs and groups
            specs = {name: s for name, s in get_kv_cache_spec(config).items() if name in spec.draft_attn_layer_names}
            layouts = [layout.name for layout in get_supported_kv_cache_layouts(
                get_current_attn_backends(config, sorted(specs)))]
            resolve_kv_cache_layout(config, [layouts], list(specs.values()))
            self.kv_cache_config = get_kv_cache_config_from_groups(config, get_kv_cache_groups(config, specs), 1 << 40)
            groups = self.kv_cache_config.kv_cache_groups
            self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
            self.blocks_per_req = [-(-self.max_model_len // b) for b in self.block_sizes]
            self.block_tables = BlockTables(self.block_sizes, self.max_num_reqs, self.max_num_tokens,
                                            self.blocks_per_req, self.device)
            self.target_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, self.device)
            spec.set_attn(None, self.kv_cache_config, self.block_tables, self.target_buffers, [])
            self.kv_caches = init_kv_cache(config.compilation_config.static_forward_context, self.kv_cache_config,
                                           self.device, self.block_sizes, config, block_tables=self.block_tables,
                                           attn_groups=(g for gs in spec.attn_groups for g in gs))
            spec.init_cudagraph_manager(CUDAGraphMode.NONE)
        for cache in self.kv_caches.values():   # an entry read before it is written shows up as NaN
            # an FP8 cache is a uint8 tensor: 0x7F is NaN in float8_e4m3fn and float8_e5m2 alike
            cache.fill_(0x7F if cache.dtype == torch.uint8 else float("nan"))
        self.draft_layers = {name: module for name, module in config.compilation_config.static_forward_context.items()
                             if name in spec.draft_attn_layer_names}
        # a free list of physical blocks (0 is vLLM's null block), handed out in a shuffled order
        self.free_blocks = list(range(1, self.kv_cache_config.num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.owned: dict[int, list[int]] = {}

    def ensure_blocks(self, state: int, num_tokens: int) -> None:
        """Request-state slot ``state`` holds pages for positions ``[0, num_tokens)``."""
        owned = self.owned.setdefault(state, [])
        new = [self.free_blocks.pop() for _ in range(-(-num_tokens // self.block_sizes[0]) - len(owned))]
        if new:
            self.block_tables.append_block_ids(state, (new,), overwrite=not owned)
            owned.extend(new)

    def batch(self, rows):
        """The target's verified batch ``rows = [(state, positions)]`` as an ``InputBatch`` (the fields
        ``propose`` reads; the rest ``make_dummy``'s, on buffers of their own)."""
        from vllm.v1.worker.gpu.input_batch import InputBatch

        lens = [len(p) for _, p in rows]
        base = InputBatch.make_dummy(len(rows), sum(lens), self.target_buffers)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        states = [s for s, _ in rows]
        return dataclasses.replace(
            base, idx_mapping=torch.tensor(states, dtype=torch.int64), idx_mapping_np=np.array(states, dtype=np.intp),
            expanded_idx_mapping=torch.tensor(states, dtype=torch.int64),
            num_scheduled_tokens=np.array(lens, dtype=np.int32), query_start_loc=torch.from_numpy(qsl.copy()),
            query_start_loc_np=qsl, positions=torch.tensor([x for _, p in rows for x in p], dtype=torch.int64),
            seq_lens_cpu_upper_bound=torch.tensor([p[-1] + 1 for _, p in rows], dtype=torch.int32))

    def propose(self, rows, aux_hidden_states, num_sampled, num_rejected, last_sampled):
        """One ``propose`` (``rows`` as :meth:`batch` takes them; ``last_sampled``: state -> bonus token):
        the block tables gathered for the batch first, as the runner does. Returns the drafts ``[R, K]``."""
        from vllm.config import set_current_vllm_config

        self.block_tables.apply_staged_writes()
        batch = self.batch(rows)
        self.block_tables.gather_block_tables(batch.idx_mapping, num_reqs_padded=batch.num_reqs)
        sampled = torch.zeros(self.max_num_reqs, 1, dtype=torch.int64)
        for state, token in last_sampled.items():
            sampled[state, 0] = token
        with set_current_vllm_config(self.config):
            drafts = self.spec.propose(
                batch, {}, {}, None, aux_hidden_states, torch.tensor(num_sampled, dtype=torch.int32),
                torch.tensor(num_rejected, dtype=torch.int32), sampled,
                torch.zeros(1, self.max_num_reqs, dtype=torch.int32),
                torch.zeros(self.max_num_reqs, dtype=torch.float32), torch.zeros(self.max_num_reqs, dtype=torch.int64))
        return drafts.clone()


# --- the target's side, and rounds of drafting -------------------------------------------------------------

class Target:
    """The transformers target: hidden states at the drafter's taps, greedy tokens (``dtype``: the one the
    speculator serves in, as a target served in it hands its hidden states over)."""

    def __init__(self, path: Path, taps, dtype=torch.float32):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        self.taps = list(taps)

    @torch.no_grad()
    def __call__(self, tokens):
        """``(aux [len(taps)] x [T, H], greedy [T])``: vLLM's aux layer ``t + 1`` is the residual stream after
        decoder layer ``t``, transformers' ``hidden_states[t + 1]``."""
        out = self.model(torch.tensor([tokens]), output_hidden_states=True)
        return [out.hidden_states[t + 1][0] for t in self.taps], out.logits[0].argmax(-1)


@dataclasses.dataclass
class Request:
    state: int                    # its request-state slot
    tokens: list[int]             # committed tokens (the drafter's context once proposed on)
    bonus: int | None = None      # the last sampled token (position len(tokens))
    drafts: list[int] | None = None


def run_rounds(speculator: Speculator, target: Target, schedule):
    """Drive ``speculator`` through ``schedule``: one list per propose step of ``(state, action)``, the
    action a prompt (a list: the request's prefill, in request-state slot ``state``) or the number of
    its previous drafts the target rejects, or a callable making the prompt from the requests so far
    (``{state: Request}``). Each request's drafts are verified as vLLM does: the target runs ``[bonus] +
    drafts``, keeps the accepted ones and samples its greedy token after them (acceptance is forced by
    the schedule: random drafts match nothing). Returns per step ``dict(drafts [R, K] int64, logits
    [R * K, vocab] (the drafter's, as its sampler saw them), rows (the batch: state, target positions),
    rejected, context (each row's committed tokens), bonus)``; DSpark's and XPress's logits are their base
    logits, XPress's ``[R * (K + 1), vocab]`` (the anchor row too)."""
    k = speculator.k
    logits_seen = []
    # DFlash samples through the speculator's compute_draft_logits; DSpark and XPress take the base logits
    # from the drafter model's own (before the Markov bias / the Jacobi refinement)
    owners = [o for o in (speculator.spec, speculator.spec.model) if hasattr(o, "compute_draft_logits")]

    def recording(original):
        def compute_draft_logits(*args, **kwargs):
            out = original(*args, **kwargs)
            logits_seen.append(out.detach().clone())
            return out
        return compute_draft_logits

    for owner in owners:                  # instance attributes, removed afterwards
        owner.compute_draft_logits = recording(owner.compute_draft_logits)
    requests: dict[int, Request] = {}
    steps = []
    try:
        for step in schedule:
            rows, aux_rows, num_sampled, num_rejected = [], [], [], []
            for state, action in step:
                if callable(action):                                     # a prompt made from the requests so far
                    action = action(requests)
                if isinstance(action, (list, tuple)):                    # a new request's prefill
                    req = requests[state] = Request(state, list(action))
                    aux, greedy = target(req.tokens)
                    positions = list(range(len(req.tokens)))
                    req.bonus = int(greedy[-1])
                    num_sampled.append(1)
                    num_rejected.append(0)
                else:                                                    # verify [bonus] + drafts, reject some
                    req, rejected = requests[state], action
                    verified = [req.bonus] + req.drafts
                    start = len(req.tokens)
                    aux, greedy = target(req.tokens + verified)
                    aux = [h[start:] for h in aux]
                    positions = list(range(start, start + k + 1))
                    accepted = k - rejected
                    req.tokens += verified[:accepted + 1]
                    req.bonus = int(greedy[len(req.tokens) - 1])
                    num_sampled.append(accepted + 1)
                    num_rejected.append(rejected)
                # pages for the context and the block's rows (which reach position len(tokens) + k)
                speculator.ensure_blocks(req.state, len(req.tokens) + k + 1)
                rows.append((req.state, positions))
                aux_rows.append(aux)
            aux_hidden = [torch.cat([a[i] for a in aux_rows]) for i in range(len(target.taps))]
            logits_seen.clear()
            drafts = speculator.propose(rows, aux_hidden, num_sampled, num_rejected,
                                        {s: requests[s].bonus for s, _ in rows})
            for (state, _), row in zip(rows, drafts.tolist()):
                requests[state].drafts = row
            logits = torch.cat([x.flatten(0, -2) for x in logits_seen]) if logits_seen else None    # [rows, vocab]
            steps.append(dict(drafts=drafts, logits=logits, rows=rows,
                              rejected=num_rejected, context=[list(requests[s].tokens) for s, _ in rows],
                              bonus=[requests[s].bonus for s, _ in rows]))
    finally:
        for owner in owners:
            del owner.compute_draft_logits
    return steps


# --- fold's attention calls, and the reference they must match --------------------------------------------

FORWARD = inspect.signature(FoldAttentionImpl.forward)


def keep_attention(impl, args, kwargs, output):
    """One ``FoldAttentionImpl.forward`` call: the query, the cache read back densely per sequence (NaN past
    its length), the output, and what the layer reads by."""
    bound = FORWARD.bind(impl, *args, **kwargs).arguments
    query, kv_cache, meta, layer = bound["query"], bound["kv_cache"], bound["attn_metadata"], bound["layer"]
    if meta is None:                                                         # a profiling / dummy run
        return dict(layer=layer.layer_name, dummy=True)
    tokens = meta.num_actual_tokens
    k_pages, v_pages = cache_pages(kv_cache, impl.head_size, impl.cache_dtype)
    seq_lens = meta.seq_lens.tolist()
    dense = dense_cache(k_pages, v_pages, meta.block_table, seq_lens, impl.scales(layer))
    return dict(layer=layer.layer_name, dummy=False, num_reqs=meta.num_reqs, read=impl.read, rope=impl.rope, sinks=impl.sinks, scale=impl.scale,
                sliding=impl.sliding_window, causal=impl.causal, softcap=impl.softcap, uniform=meta.uniform, n_q=meta.max_query_len,
                q=query[:tokens].clone(), k=dense[0].to(query.dtype), v=dense[1].to(query.dtype), seq_lens=seq_lens,
                out=output[:tokens].clone())


def recorded_rounds(speculator: Speculator, target: Target, schedule, keep=keep_attention) -> dict:
    """:func:`run_rounds` with every ``FoldAttentionImpl.forward`` call kept (``keep``: as
    :func:`keep_attention`): ``dict(speculator, steps, calls)``."""
    with Recorder(FoldAttentionImpl, "forward", keep) as calls:
        steps = run_rounds(speculator, target, schedule)
    return dict(speculator=speculator, steps=steps, calls=calls.calls)


def tp_rank(rank: int, world_size: int, port: int, target: str, drafter: str, schedule, out: str) -> None:
    """One rank of a tensor-parallel run, in a process of its own (``torch.multiprocessing.spawn``): the
    process set up as the ``v2_process`` fixture does (:func:`patched`, ``fold.vllm.register()``), a gloo
    world of ``world_size`` at ``port``, a :class:`Speculator` with ``tp=world_size`` through ``schedule``
    (lists only) with every fold call kept; ``torch.save`` s ``dict(steps, calls, heads)`` to
    ``out/rank<rank>.pt`` (``heads``: per draft layer the impl's ``(num_heads, num_kv_heads)``)."""
    from tests.vllm.pair import TAPS

    with patched():
        fold.vllm.register()
        with distributed(world_size, rank, port):
            speculator = Speculator(Path(target), Path(drafter), tp=world_size)
            result = recorded_rounds(speculator, Target(Path(target), TAPS), schedule)
            heads = {name: (layer.impl.num_heads, layer.impl.num_kv_heads, type(layer.impl).__name__)
                     for name, layer in speculator.draft_layers.items()}
    torch.save(dict(steps=result["steps"], calls=result["calls"], heads=heads), Path(out) / f"rank{rank}.pt")


def truth(call, upcast, softcap=True):
    """``fold_attention_ref`` of one recorded call (its layer's read, window, causality and soft cap, the same
    cache; ``softcap=False`` leaves the cap out)."""
    read, n_q = call["read"], call["n_q"]
    q = call["q"].view(-1, n_q, *call["q"].shape[1:])
    out, lse = fold_attention_ref(
        q, torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"]), window=read.window, rope=call["rope"],
        alpha=read.alpha if read.read == "fold" else 1.0, cache_seqlens=call["seq_lens"], keys_rotated=False,
        queries_rotated=True, softmax_scale=call["scale"], far_position=FAR_POSITION[read.read],
        sliding_window=call["sliding"], causal=call["causal"], softcap=call["softcap"] if softcap else None,
        upcast=upcast)
    if call["sinks"] is not None:
        out = out * torch.exp(lse - torch.logaddexp(lse, call["sinks"].to(lse.dtype)))[..., None]
    return out.flatten(0, 1)


# --- an independent plain-PyTorch DFlash forward (float64; float32: the tolerance rule's twin) ---------

def dflash_layer_modes(cfg: dict) -> list[tuple[int | None, bool]]:
    """Per drafter layer ``(sliding_window, causal)`` from a z-lab DFlash config.json (the dict), by the rule
    the DFlash drafters state: ``dflash_config.use_swa`` makes every layer sliding unless ``layer_types``
    names some sliding ones, else ``layer_types[i] == "sliding_attention"``; the window is
    ``dflash_config.swa_window_size`` (else ``sliding_window``); a layer is causal if ``is_causal`` or
    ``dflash_config.causal`` says so, else if ``layer_types`` marks it sliding."""
    dflash = cfg.get("dflash_config") or {}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    marked = [t == "sliding_attention" for t in types] if types else [False] * n
    sliding = [True] * n if dflash.get("use_swa") and not any(marked) else marked
    window = dflash.get("swa_window_size", cfg.get("sliding_window"))
    stated = cfg.get("is_causal", dflash.get("causal"))
    modes = []
    for i in range(n):
        assert not sliding[i] or window is not None, "a sliding layer needs a window"
        modes.append((window if sliding[i] else None, marked[i] if stated is None else bool(stated)))
    return modes


class PlainDFlash:
    """The z-lab DFlash drafter of a directory in float64 plain PyTorch, with the target's embedding and LM
    head: context K/V from ``hidden_norm(fc(concat(aux)))`` at the context positions, the block
    ``[bonus, mask x K]`` at the next positions through Qwen3 layers (q/k RMSNorm, neox RoPE, ordinary
    attention over context and block, non-causal), the final norm, the LM head. No vLLM and no fold
    (``read``: a fold block's read, by ``reference.fold_attention_ref`` in place of ordinary attention,
    with each layer's sliding window and causality as :func:`dflash_layer_modes` reads config.json)."""

    def __init__(self, drafter_dir: Path, target: Target, dtype: torch.dtype = torch.float64):
        import json

        from safetensors.torch import load_file

        self.dtype = dtype            # float64: the truth; float32: what PyTorch itself gets (the tolerance rule)
        self.cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
        self.w = {k: v.to(dtype) for k, v in load_file(str(Path(drafter_dir) / "model.safetensors")).items()}
        self.embed = target.model.model.embed_tokens.weight.detach().to(dtype)
        self.head = target.model.lm_head.weight.detach().to(dtype)
        self.target = target
        c = self.cfg
        self.hq, self.hkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps, self.mask = c["rms_norm_eps"], c["dflash_config"]["mask_token_id"]
        self.modes = dflash_layer_modes(c)                     # per layer (sliding_window, causal)
        theta = c["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)

    def norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, positions):                          # x [T, H, d], neox (rotate-half) style
        angle = positions.double()[:, None] * self.inv_freq[None, :]
        cos, sin = (torch.cat((f(angle), f(angle)), -1)[:, None].to(self.dtype) for f in (torch.cos, torch.sin))
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def attend(self, q, keys, values, read, sliding=None, causal=False):
        """``q [n_q, Hq, d]`` rotated at its positions over ``keys/values [L, Hkv, d]`` (keys rotated);
        ``sliding``, ``causal``: the layer's (the reference read's per-layer rule)."""
        if read is None:
            if sliding is not None or causal:
                raise NotImplementedError("the plain forward reads sliding / causal layers by a fold read only")
            group = self.hq // self.hkv
            scores = torch.einsum("rhd,jhd->hrj", q, keys.repeat_interleave(group, 1)) * self.d ** -0.5
            return torch.einsum("hrj,jhd->rhd", scores.softmax(-1), values.repeat_interleave(group, 1))
        rope = fold.Rope(self.inv_freq.float(), rotary_dim=self.d)
        out, _ = fold_attention_ref(q[None], keys[None], values[None], window=read.window, rope=rope,
                                    alpha=read.alpha if read.read == "fold" else 1.0, keys_rotated=True,
                                    queries_rotated=True, softmax_scale=self.d ** -0.5,
                                    far_position=FAR_POSITION[read.read], sliding_window=sliding, causal=causal,
                                    upcast=self.dtype == torch.float64)   # float32: the reference in float32
        return out[0].to(self.dtype)

    @torch.no_grad()
    def logits(self, context_tokens, bonus, k, read=None):
        """``[k, vocab]`` in ``dtype``: the logits of the block's mask rows after ``context_tokens``."""
        w, n = self.w, len(context_tokens)
        aux, _ = self.target(list(context_tokens))
        ctx = self.norm(torch.cat(aux, dim=-1).to(self.dtype) @ w["fc.weight"].T, w["hidden_norm.weight"])  # [n, H]
        ctx_pos, q_pos = torch.arange(n), torch.arange(n, n + k + 1)
        residual = self.embed[torch.tensor([bonus] + [self.mask] * k)]
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."

            def proj(x, name, heads):
                return (x @ w[p + f"self_attn.{name}_proj.weight"].T).view(-1, heads, self.d)

            x = self.norm(residual, w[p + "input_layernorm.weight"])
            q = self.norm(proj(x, "q", self.hq), w[p + "self_attn.q_norm.weight"])
            kb = self.norm(proj(x, "k", self.hkv), w[p + "self_attn.k_norm.weight"])      # the block's own rows
            kc = self.norm(proj(ctx, "k", self.hkv), w[p + "self_attn.k_norm.weight"])    # the context's
            vb, vc = proj(x, "v", self.hkv), proj(ctx, "v", self.hkv)
            keys = torch.cat((self.rope(kc, ctx_pos), self.rope(kb, q_pos)))
            sliding, causal = self.modes[i]
            attn = self.attend(self.rope(q, q_pos), keys, torch.cat((vc, vb)), read, sliding,
                               causal).reshape(k + 1, -1)
            residual = residual + attn @ w[p + "self_attn.o_proj.weight"].T
            x = self.norm(residual, w[p + "post_attention_layernorm.weight"])
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            residual = residual + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return self.norm(residual, w["norm.weight"])[1:] @ self.head.T


def check_against_plain(steps, plain: PlainDFlash, plain32: PlainDFlash, read=None) -> None:
    """Every recorded step's and row's logits against ``plain`` (float64, the truth) by the tolerance rule
    (``plain32``: the same forward in float32), and its drafts that forward's argmax."""
    for i, step in enumerate(steps):
        for r, (context, bonus) in enumerate(zip(step["context"], step["bonus"], strict=True)):
            want = plain.logits(context, bonus, K, read=read)
            got = step["logits"][r * K:(r + 1) * K]
            check_close(f"step {i} row {r}", got, want, plain32.logits(context, bonus, K, read=read), torch.float32)
            assert step["drafts"][r].tolist() == want.argmax(-1).tolist(), f"step {i} row {r}"
