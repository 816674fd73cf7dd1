"""``pdserve models``: the converted models and their folders, the folder a client uses as its tokenizer path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdserve.services import cli

DEFAULT = "smollm2-135m-instruct"


def converted(cache: Path, name: str) -> Path:
    folder = cache / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run(*args: str):
    return CliRunner().invoke(cli.main, ["models", *args])


def test_lists_each_converted_model_with_its_folder_and_skips_half_written_ones(cache):
    default, other = converted(cache, DEFAULT), converted(cache, "tiny-model.Q8_0-0123456789ab")
    converted(cache, f".{DEFAULT}.k2j4h1x9")  # a conversion still being written
    (cache / "models" / "not-a-model").mkdir()
    result = run()
    assert result.exit_code == 0, result.output
    width = len("tiny-model.Q8_0-0123456789ab")
    assert result.output.splitlines() == [f"{DEFAULT:<{width}}  {default}", f"tiny-model.Q8_0-0123456789ab  {other}"]


def test_a_known_model_not_converted_yet_says_how_to_convert_it(cache):
    result = run()
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        f"{DEFAULT}  (not converted yet: `pdserve models --path {DEFAULT}` converts it)"]
    assert result.stderr == f"no converted models in {cache / 'models'}\n"


def test_path_prints_only_the_folder_of_a_converted_model(cache, tmp_path):
    converted(cache, DEFAULT)
    gguf_made = converted(cache, "tiny-model-0123456789ab")
    assert run("--path", DEFAULT).stdout == f"{cache / 'models' / DEFAULT}\n"
    assert run("--path", "tiny-model-0123456789ab").stdout == f"{gguf_made}\n"
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert run("--path", str(local)).stdout == f"{local}\n"  # a local model folder is its own path


def test_path_of_an_unknown_model_is_one_clear_error(cache):
    converted(cache, "tiny-model-0123456789ab")
    result = run("--path", "llama-9000")
    assert result.exit_code == 1
    assert result.output == (f"Error: --path: model 'llama-9000' is neither a known name ({DEFAULT}), a local "
                             "Hugging Face model directory, nor a .gguf file; converted: tiny-model-0123456789ab\n")


@pytest.mark.slow
def test_path_converts_a_known_model_once_with_a_progress_bar(tmp_path, model_dir):
    cache = tmp_path / "cache"
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "models", "--path", DEFAULT], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = cache / "models" / DEFAULT
    assert out.stdout == f"{folder}\n"  # only the path: `--tokenizer $(pdserve models --path ...)` works
    frames = out.stderr.replace("\r", "\n").splitlines()
    bar = [f.rstrip() for f in frames if f.startswith(f"converting {DEFAULT}: ")]
    assert bar[-1].startswith(f"converting {DEFAULT}: 100%|██████████| [") and bar[-1].endswith("], done"), frames
    for step in ("reading the tokenizer", "reading the config", "dequantizing the weights", "writing safetensors"):
        assert any(f.endswith(step) for f in bar), (step, frames)
    assert not any("de-quantizing GGUF tensors" in f or "Writing model shards" in f for f in frames), frames
    # the same checkpoint the session's conversion made (the oracle: the model every other test runs)
    from safetensors.torch import load_file

    ours, reference = load_file(folder / "model.safetensors"), load_file(Path(model_dir) / "model.safetensors")
    assert ours.keys() == reference.keys() and all((ours[k] == reference[k]).all() for k in ours)
    assert (folder / "tokenizer.json").read_bytes() == (Path(model_dir) / "tokenizer.json").read_bytes()
    listed = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "models"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.stdout == f"{DEFAULT}  {folder}\n"
    again = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "models", "--path", DEFAULT], env=env,
                           capture_output=True, text=True, timeout=120)
    assert (again.stdout, again.stderr) == (f"{folder}\n", "")  # converted once: no bar the second time
