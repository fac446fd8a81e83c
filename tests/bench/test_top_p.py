"""bench/top_p.py: its arguments are checked before it looks for a GPU, and without one it says so."""

import pytest
import torch

from bench import top_p


@pytest.mark.parametrize("shapes", ["64", "64x0", "0x8", "axb", "8x65"])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit) as e:
        top_p.main(["--shapes", shapes])
    assert e.value.code == 2 and "--shapes" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit):
        top_p.main(["--shapes", "1x1"])
    assert "needs a CUDA device" in capsys.readouterr().err
