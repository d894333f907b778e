"""DCP's load retries a failed metadata read rank-locally (`read_metadata(rank=...)`, for a
`__<rank>.metadata`): the safetensors reader answers it with the failure already met, without
reading the headers again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from finetune_trainer.location import Location, locate
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader


def test_a_failed_header_read_is_not_read_again_by_dcps_rank_local_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two files holding tensor w: refused (which copy would be read is an accident).
    save_file({"w": torch.zeros(2, 3)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    listings: list[str] = []
    real = Location.children

    def counting(self: Location) -> object:
        listings.append(self.path)
        return real(self)

    monkeypatch.setattr(Location, "children", counting)
    reader = RangedSafetensorsReader(locate(str(tmp_path), "test"))
    with pytest.raises(BaseException, match="tensor w is also in"):
        dcp.load({"w": torch.empty(2, 3)}, storage_reader=reader, no_dist=True)
    assert listings == [str(tmp_path)]  # one read of the prefix (before: two)
    assert isinstance(reader.failure, ValueError)
