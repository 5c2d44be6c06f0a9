"""`modes` and `share` in the run config: each mistake refused in one line naming the file
and the field."""

from __future__ import annotations

import pytest

from foundation.errors import ConfigError
from tests.conftest import write_config


def load(tmp_path, modes: str, cap: str = "1000", extra_category: str = ""):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')
    return write_config(tmp_path, f"""
run = "modes"
output_dir = "{tmp_path / 'out'}"
cap_tokens = {cap}
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
sampling = {{ max_new_tokens = 64, temperature = 1.0 }}
{modes}
{extra_category}
""")


def category(tmp_path, name: str) -> str:
    """Another category's table over the same source."""
    return f"""[[category]]
name = "{name}"
source = "{tmp_path / 'ids.jsonl'}"
format = "input_ids"
sampling = {{ max_new_tokens = 64, temperature = 1.0 }}
"""


@pytest.mark.parametrize(("modes", "field"), [
    ('modes = [{ name = "x", weight = 1 }, { name = "x", weight = 2 }]',
     "$.category[0].modes[1].name: duplicate mode 'x'"),
    ('modes = [{ name = "x", weight = 0 }]', "$.category[0].modes[0].weight"),
    ('modes = [{ name = "x", weight = -1 }]', "$.category[0].modes[0].weight"),
    ('modes = [{ name = "x", weight = 1, sampling = { temprature = 0.5 } }]',
     "$.category[0].modes[0].sampling"),
    ('modes = [{ name = "x", weight = 1, sampling = { top_p = 2.0 } }]',
     "$.category[0].modes[0].sampling"),
    ('modes = [{ name = "x", weight = 1, colour = 1 }]', "$.category[0].modes[0]"),
    ('share = "tokens"', "$.category[0].share: a share between modes needs `modes`"),
    ('share = "bytes"\nmodes = [{ name = "x", weight = 1 }]', "$.category[0].share"),
    ('split_of = "b"', "$.category[0]: split_of and only_mode are set by tokencap"),
])
def test_a_bad_mode_is_refused_naming_file_and_field(tmp_path, modes: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, modes)
    assert "run.toml" in str(err.value) and field in str(err.value)
    assert "\n" not in str(err.value)


def test_share_tokens_needs_a_cap(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\$.category\[0\].share: .* has none"):
        load(tmp_path, 'share = "tokens"\nmodes = [{ name = "x", weight = 1 }]', cap='"none"')


def test_a_mode_budget_may_not_take_a_categorys_name(tmp_path) -> None:
    other = category(tmp_path, "a.x")
    with pytest.raises(ConfigError, match="'a.x' is both a category and the budget of a mode"):
        load(tmp_path, 'share = "tokens"\nmodes = [{ name = "x", weight = 1 }]',
             extra_category=other)


def test_modes_survive_the_configs_json_copy(tmp_path) -> None:
    from foundation.config import config_from_json, config_to_json

    cfg = load(tmp_path, 'share = "tokens"\nmodes = [{ name = "x", weight = 1, sampling = '
               '{ temperature = 0.5 } }, { name = "y", weight = 3 }]')
    assert config_from_json(config_to_json(cfg)) == cfg
    assert [cfg.cap_for(c) for c in cfg.category] == [250, 750]


def test_a_budgets_table_is_its_categorys(tmp_path) -> None:
    other = category(tmp_path, "b")
    cfg = load(tmp_path, 'share = "tokens"\nmodes = [{ name = "x", weight = 1 }, '
               '{ name = "y", weight = 1 }]', extra_category=other)
    assert [c.name for c in cfg.category] == ["a.x", "a.y", "b"]
    assert [cfg.table_index(c) for c in cfg.category] == [0, 0, 1]
