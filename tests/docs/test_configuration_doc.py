"""docs/CONFIGURATION.md is the config reference: every key a user may write is named in it
(the keys the producer sets itself are not the user's)."""

from __future__ import annotations

from foundation.config import Category, HiddenStates, Mode, RunConfig, SamplingParams
from tests.conftest import ROOT

SET_BY_THE_PRODUCER = {"made_by", "reply_markers", "category", "stage", "hidden_size",
                       "num_layers"}


def test_every_config_key_is_in_the_reference() -> None:
    doc = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    missing = [f"{struct.__name__}.{name}"
               for struct in (RunConfig, Category, Mode, SamplingParams, HiddenStates)
               for name in struct.__struct_fields__
               if name not in SET_BY_THE_PRODUCER and f"`{name}`" not in doc]
    assert missing == []
