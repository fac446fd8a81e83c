"""CPU smoke of bench/step_profile.py: its three same-run paths (native kernels where the device has
them, torch matmuls, torch attention) run end to end and the JSON carries their ratios."""

import json

from bench import step_profile
from bench.common import parse_summary


def test_step_profile_smoke(tmp_path, capsys):
    out = tmp_path / "sp.json"
    assert step_profile.main(["--device", "cpu", "--batches", "1", "--ks", "1,2", "--repeats", "1", "--prefix", "16",
                              "--skip-eager", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for path in ("native", "torch_linear", "torch_attention"):
        assert set(res[path]) >= {"B1_K1", "B1_K2", "prefill_ms"} and res[path]["B1_K1"]["step_ms"] > 0
    assert set(res["summary"]["native_vs_torch_linear"]) == {"B1_K1", "B1_K2"}
    assert "eager_ops" not in res and parse_summary(capsys.readouterr().out)


def test_step_profile_kernel_table(tmp_path):
    out = tmp_path / "sp.json"
    assert step_profile.main(["--device", "cpu", "--batches", "1", "--ks", "2", "--repeats", "1", "--prefix", "16",
                              "--skip-eager", "--kernels", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for path in ("native", "torch_linear", "torch_attention"):
        table = res[path]["B1_K2"]["kernels"]
        assert 0 < len(table) <= 10 and all(len(r) == 3 and r[1] > 0 and r[2] > 0 for r in table)
        assert [r[2] for r in table] == sorted((r[2] for r in table), reverse=True)


def test_step_profile_refuses_a_negative_kernel_count(capsys):
    import pytest

    with pytest.raises(SystemExit):
        step_profile.main(["--device", "cpu", "--kernels", "-1"])
    assert "--kernels: expected 0" in capsys.readouterr().err


def test_step_profile_first_launch(tmp_path):
    out = tmp_path / "sp.json"
    assert step_profile.main(["--device", "cpu", "--batches", "1", "--ks", "1,2", "--prefix", "16", "--first-launch",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())["first_launch"]
    assert set(res) == {"upload_at_first_launch", "upload_at_capture"}
    assert all(v["first_launch_host_ms"] > 0 and v["later_launch_host_ms"] > 0 for v in res.values())
