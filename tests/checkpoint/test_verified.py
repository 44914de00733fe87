"""DCP pieces of verified checkpoints, in one process: the digests taken while DCP writes, and the allowlisted
reading of DCP's ``.metadata`` pickle."""

import os
import pickle

import pytest
import torch

from neva.checkpoint import dcp
from neva.checkpoint.verified import CheckpointError, file_digest


def test_dcp_digests_are_those_of_the_files_and_real_metadata_passes_the_allowlist(tmp_path):
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5).to(torch.bfloat16))]
    digests = dcp.save(tmp_path, named, None)
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(digests) == on_disk  # shards and .metadata (renamed from its temp name)
    assert all(digests[name] == file_digest(tmp_path / name) for name in on_disk)
    loaded = [(n, torch.zeros_like(t)) for n, t in named]
    dcp.load(tmp_path, loaded, None)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, loaded))


def test_planted_dcp_metadata_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    named = [("a.weight", torch.randn(3, 4))]
    dcp.save(tmp_path, named, None)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"posix\.system is not part of DCP metadata"):
        dcp.load(tmp_path, named, None)
    assert not marker.exists()
