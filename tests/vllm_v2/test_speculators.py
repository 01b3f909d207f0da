"""fold's read on the draft layers of vLLM 0.34's other V2 speculators, driven on a CPU (``harness.py``).

Beside ``DFlashSpeculator`` (``test_speculator.py``), vLLM 0.34's ``vllm/v1/worker/gpu/spec_decode/``
has four more speculators that run a drafter fold registers, each a ``DFlashSpeculator`` subclass
whose draft layers are DFlash attention layers (``self_attn`` with ``rotary_emb``, RoPE'd keys written
per head through the layer's backend, by the context precompute and by the block's own forward):

- ``DSparkSpeculator``: ``Qwen3DSparkModel`` and ``Gemma4DSparkModel`` (K query rows per request, the
  anchor the first prediction; a sequential Markov head over the base logits);
- ``XPressSpeculator``: ``Qwen3XPressModel`` (a Jacobi refiner over the base logits);
- ``DFlash2Speculator``: ``DFlash2DraftModel`` (convolutions around each layer, a candidate walk) and
  ``DFlash2RicursiveDraftModel`` (its NoPE layers keep vLLM's read);
- ``LiLiCorrSpeculator`` (a ``DFlash2Speculator``): ``LiLiCorrDraftModel`` (a candidate lattice).

Each drafter (``drafters.py``) reads ``"fold"`` with a window of :data:`SMALL_W`, shorter than every
context, through :data:`SCHEDULE` (a prefill of two requests, then verifies rejecting some, all and
none of the drafts). Every fold call is held to ``reference.fold_attention_ref`` in float64 (the
tolerance rule); DSpark's drafts to ``fold.spec_decode``'s drafter of the same directory, XPress's base
logits to ``harness.PlainDFlash`` with the reference read. The other drafters of vLLM 0.34's registry
(``fold.vllm.compat.NOT_COVERED``) keep vLLM's own class.
"""

import json
import re
import warnings

import pytest
import torch
import transformers

import fold.spec_decode
import fold.vllm
from fold.vllm import compat
from fold.vllm.backend import FoldAttentionBackend, FoldAttentionImpl
from fold.vllm.config import parse_block
from fold.vllm.models import is_nope, rope_of
from reference.tolerance import check_close
from tests.vllm.pair import TAPS
from tests.vllm_v2 import drafters
from tests.vllm_v2.harness import (SHORT_SCHEDULE, SMALL_W, K, PlainDFlash, Recorder, Speculator, Target,
                                    recorded_rounds, truth)

ALPHA = 2.0
SCHEDULE = SHORT_SCHEDULE
# name -> (vLLM's speculator class, its drafter model class, query rows per request, the method asked for)
RUNS = {
    "dspark": ("DSparkSpeculator", "Qwen3DSparkForCausalLM", K, "dspark"),
    "gemma4_dspark": ("DSparkSpeculator", "Gemma4DSparkForCausalLM", K, "dspark"),
    "xpress": ("XPressSpeculator", "Qwen3XPressForCausalLM", K + 1, "dflash"),
    "dflash2": ("DFlash2Speculator", "DFlash2Qwen3ForCausalLM", K + 1, "dflash"),
    "ricursive": ("DFlash2Speculator", "RicursiveDFlash2ForCausalLM", K + 1, "dflash"),
    "lilicorr": ("LiLiCorrSpeculator", "LiLiCorrForCausalLM", K + 1, "dflash"),
}
NOPE = 1            # the Ricursive drafter's NoPE layer (config.no_rope_layers)


def write_drafter(name, root, target):
    """The ``name`` drafter's source directory (no fold block)."""
    if name == "dspark":
        return drafters.dspark(root / name, target, block_size=K)
    if name == "gemma4_dspark":
        return drafters.gemma4_dspark(root / name, target, block_size=K)
    if name == "xpress":
        return drafters.xpress(root / name, block_size=K + 1)
    if name == "dflash2":
        return drafters.dflash2(root / name)
    if name == "ricursive":
        return drafters.dflash2(root / name, no_rope_layers=[NOPE])
    return drafters.lilicorr(root / name)


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    return v2_process.make_pair(tmp_path_factory.mktemp("v2-speculators"))


@pytest.fixture(scope="module")
def target(pair):
    return Target(pair["target"], TAPS)


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, pair, target):
    """One speculator through :data:`SCHEDULE`, fold's calls and the stock Triton read's (the NoPE layer) kept."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    name = request.param
    source = write_drafter(name, pair["root"], pair["target"])
    drafter = fold.vllm.configure(source, pair["root"] / f"{name}-fold", read="fold", window=SMALL_W, alpha=ALPHA,
                                  backend="torch")
    speculator = Speculator(pair["target"], drafter, method=RUNS[name][3],
                            drop_target_layers=name == "gemma4_dspark")
    with Recorder(TritonAttentionImpl, "forward", lambda impl, a, kw, out: impl) as stock, \
            warnings.catch_warnings():
        # the stock kernel (the NoPE layer's) divides 0 by 0 in rows it masks, which Triton's interpreter reports
        warnings.filterwarnings("ignore", "invalid value encountered in divide", RuntimeWarning)
        result = recorded_rounds(speculator, target, SCHEDULE)
    return dict(result, name=name, source=source, drafter=drafter, stock_calls=stock.calls)


def fold_layers(run):
    """The draft layers fold serves: all but the Ricursive drafter's NoPE layer."""
    layers = run["speculator"].draft_layers
    ordered = sorted(layers, key=lambda n: int(n.split("layers.")[1].split(".")[0]))
    return [n for i, n in enumerate(ordered) if not (run["name"] == "ricursive" and i == NOPE)]


# (a) vLLM's runner picks the speculator the drafter declares, and fold serves its draft layers

def test_the_speculator_runs_its_drafter_with_folds_read(run):
    spec_cls, model_cls, n_q, _ = RUNS[run["name"]]
    speculator = run["speculator"]
    assert type(speculator.spec).__name__ == spec_cls
    assert type(speculator.spec.model).__mro__[1].__name__ == model_cls          # fold's subclass of vLLM's
    assert speculator.spec.num_query_per_req == n_q
    layers, served = speculator.draft_layers, fold_layers(run)
    assert len(layers) == 2 and set(layers) == speculator.spec.draft_attn_layer_names
    for name in served:
        assert type(layers[name].impl) is FoldAttentionImpl and layers[name].get_attn_backend() is FoldAttentionBackend
    groups = {g.backend: set(g.layer_names) for gs in speculator.spec.attn_groups for g in gs}
    assert groups[FoldAttentionBackend] == set(served)
    # every step ran fold's forward once per served layer, on a uniform batch of n_q rows per request
    calls = run["calls"]
    assert [c["layer"] for c in calls] == [n for _ in SCHEDULE for n in sorted(served)]
    assert all(not c["dummy"] and c["uniform"] and c["n_q"] == n_q for c in calls)
    assert [c["num_reqs"] for c in calls[::len(served)]] == [len(step) for step in SCHEDULE]
    assert len(run["stock_calls"]) == (len(SCHEDULE) if run["name"] == "ricursive" else 0)
    for step, scheduled in zip(run["steps"], SCHEDULE, strict=True):
        assert step["drafts"].shape == (len(scheduled), K)
        assert step["rejected"] == [n if isinstance(n, int) else 0 for _, n in scheduled]


# (b) every fold call is the reference read of the same queries over the same cache, far memory included

def test_every_fold_call_equals_the_reference(run):
    calls = run["calls"]
    assert calls
    far = 0
    for i, call in enumerate(calls):
        assert (call["read"].read, call["read"].window, call["read"].alpha) == ("fold", SMALL_W, ALPHA)
        assert call["sliding"] is None and call["sinks"] is None
        for b, length in enumerate(call["seq_lens"]):        # every entry the read covers was written
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
            far += length - call["n_q"] >= SMALL_W + call["n_q"]      # row 0 reads far memory
        check_close(f"{run['name']} call {i} ({call['layer']})", call["out"], truth(call, True), truth(call, False),
                    torch.float32)
    assert far == sum(len(c["seq_lens"]) for c in calls)      # every request of every call reads far memory


# (c) DSpark (Qwen3 and Gemma-4) drafts as fold.spec_decode's drafter of the same directory does

@pytest.fixture(scope="module")
def spec_drafter():
    """``(name, dtype) -> (drafter, target)``: fold.spec_decode's drafter of the run's directory on the
    transformers target (float64: both ``.double()``), loaded once per run and dtype."""
    cache = {}

    def get(run, dtype):
        key = (run["name"], dtype)
        if key not in cache:
            tgt = transformers.AutoModelForCausalLM.from_pretrained(str(run["speculator"].config.model_config.model),
                                                                    dtype=torch.float32).eval()
            drafter = fold.spec_decode.load_drafter(run["source"], tgt).eval()
            cache[key] = (drafter.double(), tgt.double()) if dtype == torch.float64 else (drafter, tgt)
        return cache[key]
    return get


@torch.no_grad()
def spec_round(drafter, tgt, context, bonus):
    """fold.spec_decode's round after ``context`` anchored at ``bonus`` with the ``"fold"`` read:
    ``(base logits [K, vocab], greedy Markov-corrected drafts)``."""
    ids = torch.tensor([list(context)])
    state = drafter.new_state(len(context), ids.device, drafter.fc.weight.dtype)
    drafter.append_context(state, drafter.features(tgt(ids, output_hidden_states=True).hidden_states))

    def read():
        return fold.spec_decode.make_read("fold", drafter.cfg.rope, backend="torch", window=SMALL_W, alpha=ALPHA)
    logits = drafter.slot_logits(state, int(bonus), read())
    tokens, _ = drafter.draft(state, int(bonus), read())
    return logits, tokens


@pytest.mark.parametrize("run", ["dspark", "gemma4_dspark"], indirect=True)
def test_dspark_drafts_equal_fold_spec_decode(run, spec_drafter):
    d64, t64 = spec_drafter(run, torch.float64)
    d32, t32 = spec_drafter(run, torch.float32)
    assert d64.cfg.sample_from_anchor and d64.cfg.block_size == K and d64.cfg.markov_rank == drafters.MARKOV_RANK
    assert (d64.cfg.logit_softcap is not None) is (run["name"] == "gemma4_dspark")
    rows = 0
    for i, step in enumerate(run["steps"]):
        for r, (context, bonus) in enumerate(zip(step["context"], step["bonus"], strict=True)):
            want, drafts = spec_round(d64, t64, context, bonus)
            twin, _ = spec_round(d32, t32, context, bonus)
            got = step["logits"][r * K:(r + 1) * K]                  # vLLM's base logits, before the Markov bias
            check_close(f"{run['name']} step {i} row {r}", got, want, twin, torch.float32)
            assert step["drafts"][r].tolist() == drafts, f"{run['name']} step {i} row {r}"
            rows += 1
    assert rows == sum(len(step) for step in SCHEDULE)
    # the Markov head matters: the chain's drafts are not the base logits' argmax on every row
    assert any(step["drafts"][r].tolist() != step["logits"][r * K:(r + 1) * K].argmax(-1).tolist()
               for step in run["steps"] for r in range(len(step["context"])))


# (d) XPress's backbone (DFlash layers with fold's read) gives a plain DFlash forward's logits

@pytest.mark.parametrize("run", ["xpress"], indirect=True)
def test_xpress_base_logits_equal_a_plain_dflash_with_the_reference_read(run, target):
    read = parse_block(json.loads((run["drafter"] / "config.json").read_text())["fold"])
    plain, plain32 = PlainDFlash(run["source"], target), PlainDFlash(run["source"], target, torch.float32)
    for i, step in enumerate(run["steps"]):
        logits = step["logits"].view(len(step["context"]), K + 1, -1)      # [R, anchor + K masks, vocab]
        for r, (context, bonus) in enumerate(zip(step["context"], step["bonus"], strict=True)):
            check_close(f"xpress step {i} row {r}", logits[r, 1:], plain.logits(context, bonus, K, read=read),
                        plain32.logits(context, bonus, K, read=read), torch.float32)


# (e) Ricursive DFlash 2: the NoPE layer keeps vLLM's read, though its table alone would pass for a rotary one

@pytest.mark.parametrize("run", ["ricursive"], indirect=True)
def test_the_ricursive_nope_layer_keeps_vllms_read(run):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    model = run["speculator"].spec.model.model
    nope = model.layers[NOPE].self_attn
    assert type(nope.rotary_emb).__name__ == "_NoRope" and is_nope(nope.rotary_emb)
    rotary = model.layers[1 - NOPE].self_attn
    # _NoRope keeps the wrapped rotary's cos/sin table (a real one: its sines are not 0), so the table alone
    # reads as a rotary layer's and fold would un-rotate keys that were never rotated; fold goes by the class
    table = nope.rotary_emb.cos_sin_cache
    assert torch.equal(table, rotary.rotary_emb.cos_sin_cache) and table[1:, table.shape[1] // 2:].abs().max() > 0.5
    assert type(nope.attn.impl) is TritonAttentionImpl
    assert not is_nope(rotary.rotary_emb) and type(rotary.attn.impl) is FoldAttentionImpl
    # handed to fold's RoPE recovery directly, the identity is refused by name, not read as its table
    with pytest.raises(ValueError, match=r"fold cannot reproduce this drafter's rotary embedding \(_NoRope\)"):
        rope_of(nope.rotary_emb)
    assert rotary.attn.impl.rope.inv_freq.shape == (drafters.HEAD_DIM // 2,)
    assert {id(impl) for impl in run["stock_calls"]} == {id(nope.attn.impl)}


# (f) a soft-capped drafter layer is served with its cap

CAP = 0.5           # small enough to bite: the tiny drafter's scaled logits reach well past it


def test_a_gemma4_dspark_layer_with_soft_capped_attention_is_served_with_its_cap(pair, target):
    """A Gemma-4 DSpark drafter whose config sets ``attn_logit_softcapping`` hands the cap to every layer's
    Attention (``logits_soft_cap``): fold serves the layer with it, every call equals the reference read with
    that cap (far memory on every call), and the cap changes the result (the uncapped read is far off)."""
    source = drafters.gemma4_dspark(pair["root"] / "gemma4-capped", pair["target"], block_size=K,
                                    config_overrides=dict(attn_logit_softcapping=CAP))
    drafter = fold.vllm.configure(source, pair["root"] / "gemma4-capped-fold", read="fold", window=SMALL_W,
                                  alpha=ALPHA, backend="torch")
    result = recorded_rounds(Speculator(pair["target"], drafter, method="dspark", drop_target_layers=True), target,
                             SCHEDULE)
    assert {type(layer.impl) for layer in result["speculator"].draft_layers.values()} == {FoldAttentionImpl}
    calls = result["calls"]
    assert calls and all(call["softcap"] == CAP for call in calls)
    moved = 0.0
    for i, call in enumerate(calls):
        assert min(call["seq_lens"]) - K >= SMALL_W + K                      # every row reads far memory
        check_close(f"capped call {i} ({call['layer']})", call["out"], truth(call, True), truth(call, False),
                    torch.float32)
        moved = max(moved, (truth(call, True) - truth(call, True, softcap=False)).abs().max().item())
    assert moved > 0.05


def test_vllms_other_drafters_keep_vllms_class(v2_process):
    """Every DFlash-family drafter architecture of vLLM 0.34's registry (DFlash, DFlash 2, DSpark, XPress,
    LiLiCorr and the names vLLM maps to their modules) is fold's subclass where fold serves it
    (``compat.DRAFTERS``) and vLLM's own class where it does not (``compat.NOT_COVERED``, each with its
    reason: MLA caches, fused K/V writes), and fold has no class for the latter."""
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS, ModelRegistry

    import fold.vllm.models

    registered = ModelRegistry.models
    ours = {arch for arch, model in registered.items() if getattr(model, "module_name", "") == "fold.vllm.models"}
    assert ours == set(compat.available_drafters()) and "Qwen3XPressModel" in ours and "LiLiCorrDraftModel" in ours
    assert not set(compat.DRAFTERS) & set(compat.NOT_COVERED)
    for arch, reason in compat.NOT_COVERED.items():
        assert arch in registered, arch                                    # all of them are 0.34 drafters
        assert registered[arch].module_name.startswith("vllm."), arch
        assert isinstance(reason, str) and len(reason) > 20, arch
        with pytest.raises(AttributeError):
            getattr(fold.vllm.models, f"Fold{arch}")
    family = {arch for arch, (module, cls) in _SPECULATIVE_DECODING_MODELS.items()
              if re.search("dflash|dspark|xpress|lilicorr", f"{arch} {module} {cls}", re.IGNORECASE)}
    assert family == set(compat.DRAFTERS) | set(compat.NOT_COVERED)      # each one decided, none left out
