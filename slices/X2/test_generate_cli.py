"""X2: `dsv4 generate` -- one JSON document on stdout, the API's tokens, --init from a converted checkpoint,
bad input in one line with exit 2."""
import json

import torch
from click.testing import CliRunner

from dsv4.harness.generate_cli import generate_cmd
from dsv4.model.interop import to_hf
from dsv4.model.generate import generate

from ._models import debug_model


def test_cli_json_equals_api(tmp_path):
    torch.set_num_threads(1)
    model = debug_model(seed=4, shared_expert_clamp=True)     # HF clamps the shared expert: the same function
    to_hf(model, str(tmp_path / "hf"))
    r = CliRunner().invoke(generate_cmd, ["--init", str(tmp_path / "hf"), "--ids", "5,6,7,8,9", "--ids", "3,4",
                                          "--max-new-tokens", "6", "--eos", "-1", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["source"] == "hf" and doc["cache_bytes"] > 0
    # left padded batch == each row alone through the API
    for row, new in zip(([5, 6, 7, 8, 9], [3, 4]), doc["new_tokens"]):
        ref = generate(model.eval(), torch.tensor([row]), max_new_tokens=6).new_tokens[0].tolist()
        assert new == ref
    r = CliRunner().invoke(generate_cmd, ["--config", "debug", "--prompt", "def f(x):", "--max-new-tokens", "4",
                                          "--temperature", "0.8", "--top-p", "0.9", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["new_tokens"][0]) <= 4


def test_cli_bad_input_one_line(tmp_path):
    r = CliRunner().invoke(generate_cmd, ["--init", str(tmp_path / "nowhere"), "--ids", "1"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "nowhere" in r.output
    r = CliRunner().invoke(generate_cmd, ["--config", "debug", "--ids", "1,999"])
    assert r.exit_code == 2 and "vocabulary" in r.output


def test_init_from_a_dsv4_training_run(tmp_path):
    """--init RUN_DIR: the run's last checkpoint (config from meta.json) loads with its trained weights."""
    from dataclasses import replace

    from dsv4.harness.train.loading import load_model
    from dsv4.harness.train.loop import RECIPES, train
    from safetensors.torch import load_file
    torch.set_num_threads(1)
    train(replace(RECIPES["debug"], steps=2, save_interval=1), str(tmp_path), seed=1, progress=False)
    model, src = load_model(str(tmp_path))
    assert src == "dsv4:step_000002"
    saved = load_file(str(tmp_path / "checkpoints" / "step_000002" / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    r = CliRunner().invoke(generate_cmd, ["--init", str(tmp_path), "--ids", "1,2,3", "--max-new-tokens", "3",
                                          "--json"])
    assert r.exit_code == 0, r.output
