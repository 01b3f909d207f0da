"""fold's vLLM backend without an engine: what V2's CUDA graphs need (no host sync on a drafting batch,
graph support declared), the page writes (padding slots, FP8 with the layer's scales) and every read
against the reference."""

import itertools

import pytest
import torch

from fold.rope import rotate
from fold.vllm import compat
from fold.vllm.backend import FAR_POSITION, FoldMetadataBuilder, cache_pages
from fold.vllm.config import ServeRead
from reference import fold_attention_ref
from reference.tolerance import check_close
from tests.helpers import HostReads
from tests.vllm.backend_fixtures import (BLOCKS, D, HKV, HQ, PAGE, ROPE, empty_cache, fake_layer, make_batch,
                                         make_impl, positions_of, slots_of, write_all)

@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_page_writes_land_at_their_slots_and_padding_changes_nothing(cache_dtype):
    """Every valid row lands at its slot, its key un-rotated at its position (the cache holds keys as FOLD's
    far memory reads them), quantized as ``x / scale`` for FP8; padding (slot -1) rewrites only slot 0 with
    what it held; nothing else changes."""
    q, keys, values, cad = make_batch([37, 50], 4)
    impl, layer = make_impl(ServeRead("fold", 8, 2.0), cache_dtype), fake_layer(0.5, 2.0)
    kv_cache = empty_cache(cache_dtype)
    kv_cache[0] = 7 if cache_dtype != "auto" else 3.25                     # slot 0 holds something
    before = kv_cache.clone()
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    k_pages, v_pages = cache_pages(kv_cache, D, impl.cache_dtype)
    slots = slots_of(cad.block_table_tensor, [37, 50])
    got_k, got_v = k_pages[slots // PAGE, slots % PAGE].float(), v_pages[slots // PAGE, slots % PAGE].float()
    want_k = rotate(torch.cat(keys).transpose(0, 1), -positions_of(keys), ROPE, factor=1.0).transpose(0, 1)
    want_v = torch.cat(values)
    if impl.cache_dtype is not None:
        want_k = (want_k / 0.5).to(impl.cache_dtype).float()
        want_v = (want_v / 2.0).to(impl.cache_dtype).float()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    written = torch.zeros(BLOCKS * PAGE, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(BLOCKS, 1, PAGE, 1).expand_as(kv_cache)
    same = (kv_cache == before) | (torch.isnan(kv_cache.float()) & torch.isnan(before.float()))
    assert bool(same[untouched].all())


READS = [ServeRead("fold", 8, 2.0), ServeRead("rerope", 8, training_length=16), ServeRead("window", 8)]


@pytest.mark.parametrize("read, cache_dtype, sliding, backend", [
    *itertools.product(READS, ["auto"], [None, 20], ["torch", "triton"]),
    (ServeRead("fold", 8, 3.0), "fp8", None, "torch"), (ServeRead("fold", 8, 3.0), "fp8", 20, "triton"),
    (ServeRead("window", 8), "fp8_e5m2", None, "triton")])
def test_every_read_over_the_written_pages_equals_the_reference(read, cache_dtype, sliding, backend):
    """forward() of a drafting batch (written through do_kv_cache_update, FP8 with the layer's scales)
    against fold_attention_ref on the cache as stored (un-rotated keys, dequantized): both backends, sinks
    merged."""
    read = ServeRead(read.read, read.window, read.alpha, read.training_length, backend)
    q, keys, values, cad = make_batch([37, 60, 4], 4)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(3))
    impl, layer = make_impl(read, cache_dtype, sliding, causal=sliding is not None, sinks=sinks), fake_layer(0.75, 1.5)
    kv_cache = empty_cache(cache_dtype)
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
    output = torch.full_like(q, float("nan"))
    impl.forward(layer, q, None, None, kv_cache, meta, output)
    k_pages, v_pages = cache_pages(kv_cache, D, impl.cache_dtype)
    k_scale, v_scale = impl.scales(layer)                       # the layer's for an FP8 cache, else 1
    assert (k_scale, v_scale) == ((0.75, 1.5) if cache_dtype.startswith("fp8") else (1.0, 1.0))
    dense = [torch.zeros(3, 60, HKV, D) for _ in range(2)]
    for b, n in enumerate([37, 60, 4]):
        slots = slots_of(cad.block_table_tensor[b:b + 1], [n])
        dense[0][b, :n] = k_pages[slots // PAGE, slots % PAGE].float() * k_scale
        dense[1][b, :n] = v_pages[slots // PAGE, slots % PAGE].float() * v_scale
    qb = q.view(3, 4, HQ, D)
    if read.read == "rerope":
        qb = qb * torch.tensor([[max(1.0, torch.log(torch.tensor(n - 4 + r + 1.0)).item() / torch.log(
            torch.tensor(16.0)).item()) for r in range(4)] for n in [37, 60, 4]])[..., None, None]
    kw = dict(window=8, rope=ROPE, alpha=read.alpha if read.read == "fold" else 1.0, cache_seqlens=[37, 60, 4],
              keys_rotated=False, queries_rotated=True, far_position=FAR_POSITION[read.read], sliding_window=sliding,
              causal=sliding is not None)

    def want(upcast):
        out, lse = fold_attention_ref(qb, *dense, **kw, upcast=upcast)
        return (out * torch.exp(lse - torch.logaddexp(lse, sinks.to(lse.dtype)))[..., None]).flatten(0, 1)

    check_close(f"{read.read} {cache_dtype} {sliding} {backend}", output, want(True), want(False), torch.float32)


def test_the_builder_declares_uniform_batch_graphs_and_in_place_updates():
    """What V2's DFlash speculator reads before capturing its draft step in a FULL_DECODE_ONLY graph."""
    assert FoldMetadataBuilder.get_cudagraph_support(None, None) == compat.AttentionCGSupport.UNIFORM_BATCH
    assert FoldMetadataBuilder.supports_draft_decode_metadata_update
    q, keys, values, cad = make_batch([37, 50], 4)
    builder = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu"))
    meta = builder.build(0, cad)
    # the metadata aliases vLLM's persistent buffers: a captured graph reads each step's values
    assert meta.seq_lens is cad.seq_lens and meta.block_table is cad.block_table_tensor
    assert meta.slot_mapping is cad.slot_mapping and meta.causal is cad.causal
    assert builder.update_draft_decode_metadata(meta) is None


@pytest.mark.parametrize("read", READS + [ServeRead("fold", 8, 2.0, backend="triton")], ids=lambda r: r.read)
def test_a_drafting_step_compiles_as_one_graph_without_host_syncs(read):
    """build and forward (the block's keys and values written there, un-rotated at the positions its metadata
    gives) of a uniform batch under torch.compile(fullgraph=True),
    which refuses data-dependent Python (``.tolist()``, ``.item()``, ``bool(tensor)``, boolean masks):
    the same code runs eagerly and compiled, with equal results."""
    q, keys, values, cad = make_batch([37, 50], 4)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(5))
    impl, layer = make_impl(read, sliding=24, causal=True, sinks=sinks), fake_layer()
    new_k, new_v = torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    slots = torch.cat([slots_of(cad.block_table_tensor, [37, 50])[[33, 34, 35, 36, 83, 84, 85]],
                       torch.tensor([-1])])                                   # the block's rows, and padding
    cad.slot_mapping = slots

    def step(kv_cache, query, out):
        meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
        return impl.forward(layer, query, new_k, new_v, kv_cache, meta, out)

    caches = []
    for _ in range(2):
        kv_cache = empty_cache("auto")
        write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
        caches.append(kv_cache)
    eager = step(caches[0], q, torch.zeros_like(q))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")(caches[1], q, torch.zeros_like(q))
    assert torch.isfinite(eager).all()
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.nan_to_num(caches[0], 9.0), torch.nan_to_num(caches[1], 9.0))


@pytest.mark.parametrize("read, sliding", [(ServeRead("fold", 8, 2.0, backend="triton"), None),
                                           (ServeRead("rerope", 8, training_length=16, backend="triton"), 24),
                                           (ServeRead("window", 8, backend="triton"), None)])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_a_drafting_step_on_the_gpu_code_path_reads_nothing_on_the_host(read, sliding, cache_dtype):
    """build, the page writes and forward of a uniform batch with fold's kernels (the path CUDA runs)
    read no tensor on the host: what V2's captured draft step needs."""
    q, keys, values, cad = make_batch([37, 50], 4)
    cad.slot_mapping = torch.cat([slots_of(cad.block_table_tensor, [37, 50])[[33, 34, 35, 36, 83, 84, 85]],
                                  torch.tensor([-1])])
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(5))
    impl, layer = make_impl(read, cache_dtype, sliding, causal=sliding is not None, sinks=sinks), fake_layer(0.5, 2.0)
    kv_cache = empty_cache(cache_dtype)
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    output = torch.zeros_like(q)
    with HostReads() as reads:
        meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
        impl.forward(layer, q, torch.randn(8, HKV, D), torch.randn(8, HKV, D), kv_cache, meta, output)
    assert reads.calls == [] and torch.isfinite(output).all()
