"""benchmarks/host_write_sync.py times writes into device tensors behind a busy stream (GPU only): each write must be
the form its name says, and a machine without CUDA gets a clear refusal rather than a traceback."""

import sys

import pytest
import torch

from benchmarks import host_write_sync


def test_each_write_does_what_its_name_says():
    t = torch.full((128,), 9, dtype=torch.int64)
    idx = torch.tensor([3, 9])
    expected = {"t[i] = 0": {5: 0}, "t[i].zero_()": {5: 0}, "t[i:i+1].fill_(0)": {5: 0},
                "t[idx] = 1 (index tensor)": {3: 1, 9: 1}, "t[idx] = pinned upload": {3: 7, 9: 8},
                "t[idx] = pageable tensor": {3: 7, 9: 8}, "t.fill_(0) (whole)": {i: 0 for i in range(128)}}
    writes = host_write_sync.writes(t, idx)
    assert set(writes) == set(expected)
    if not torch.cuda.is_available():  # pin_memory needs CUDA: the pinned form is checked on the GPU only
        del writes["t[idx] = pinned upload"], expected["t[idx] = pinned upload"]
    for name, write in writes.items():
        t.fill_(9)
        write()
        changed = {i: int(v) for i, v in enumerate(t.tolist()) if v != 9}
        assert changed == expected[name], name


def test_a_machine_without_cuda_is_refused_clearly(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["host_write_sync.py"])
    with pytest.raises(SystemExit) as exit_:
        host_write_sync.main()
    assert exit_.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
