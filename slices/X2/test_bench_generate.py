"""X2: the decode benchmark the H200 script runs (harness/bench_generate.py, harness/device/gen_h200.sh) runs end to
end on the CPU (--smoke: debug config, tiny contexts) and reports what the H200 run stores."""
import json

from dsv4.harness.bench_generate import main
from dsv4.model.config import get_config
from dsv4.model.generate import cache_elements_per_token


def test_bench_generate_smoke(tmp_path, capsys):
    out = tmp_path / "gen.json"
    main(["--smoke", "--batch", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["context"] for r in doc["results"]] == [48, 96]
    for r in doc["results"]:
        assert "error" not in r and r["decode_tokens_per_s"] > 0 and r["batch"] == 2
        # the cache grows by the formula per token, plus its per-layer constants (ring buffers, partial states)
        assert r["cache_bytes_per_token"] >= r["cache_formula_bytes_per_token"] == \
            cache_elements_per_token(get_config("debug")) * 2
    big, small = doc["results"][1], doc["results"][0]
    grown = (big["cache_bytes"] - small["cache_bytes"]) / (2 * (big["context"] - small["context"]))
    # 48 more tokens per row = whole groups of m = 4 and m' = 16: the growth is the formula exactly (measured 540 B)
    assert grown == big["cache_formula_bytes_per_token"], grown
