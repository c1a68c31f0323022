"""Fleet files (paged.engine.fleet): valid ones parse into per-replica configs; invalid ones
fail naming the file, line and field. No engine is started."""

from __future__ import annotations

import pytest

from paged.config import EngineConfig
from paged.engine.fleet import FleetError, group_configs, load_fleet, parse_fleet

GOOD = """\
model: /models/tiny
args: {dtype: float32, kv-cache-memory: 16MiB}
replicas:
  - platform: cpu
    count: 2
    args: {max_num_seqs: 32, enable_prefix_caching: false}
  - {platform: example}       # a plugin's platform
"""


def test_a_valid_file_gives_one_config_per_replica():
    fleet = parse_fleet(GOOD)
    assert fleet.size == 3 and fleet.model == "/models/tiny"
    base = EngineConfig(max_model_len=512, max_num_seqs=8)
    cfgs = group_configs(fleet, base)
    assert [c.platform for c in cfgs] == ["cpu", "cpu", "example"]
    assert [c.max_num_seqs for c in cfgs] == [32, 32, 8]  # the group's, else the command line's
    assert {c.dtype for c in cfgs} == {"float32"} and cfgs[0].kv_cache_memory == 16 << 20
    assert not cfgs[0].enable_prefix_caching and cfgs[2].enable_prefix_caching
    assert all(c.model == "/models/tiny" and c.max_model_len == 512 for c in cfgs)
    assert all(c.data_parallel_size == 1 for c in cfgs)


def test_json_is_accepted():
    fleet = parse_fleet('{"replicas": [{"platform": "cpu", "count": 2}]}')
    assert fleet.model is None and fleet.size == 2


@pytest.mark.parametrize(
    "text, where",
    [
        # an unknown engine argument: its line, named, with the known ones listed
        (GOOD.replace("max_num_seqs: 32", "max_num_sequences: 32"),
         ["<fleet>:6:", "replicas[0].args.max_num_sequences", "unknown engine argument",
          "max_num_seqs"]),
        # a count that is not a positive integer
        (GOOD.replace("count: 2", "count: 0"), ["<fleet>:5:", "replicas[0].count", "greater"]),
        (GOOD.replace("count: 2", "count: two"), ["<fleet>:5:", "replicas[0].count"]),
        # a group without a platform: the group's line
        (GOOD.replace("{platform: example}", "{count: 1}"),
         ["<fleet>:7:", "replicas[1].platform", "required"]),
        # an unknown field in a group, and at the top
        (GOOD.replace("count: 2", "cont: 2"), ["<fleet>:5:", "replicas[0].cont", "unknown field"]),
        (GOOD + "routr: prefix\n", ["<fleet>:8:", "routr", "unknown field"]),
        # a value of the wrong type for its flag
        (GOOD.replace("max_num_seqs: 32", "max_num_seqs: lots"),
         ["<fleet>:6:", "replicas[0].args.max_num_seqs", "invalid value 'lots'"]),
        (GOOD.replace("enable_prefix_caching: false", "enable_prefix_caching: 3"),
         ["<fleet>:6:", "enable_prefix_caching", "true or false"]),
        # what the file says itself does not belong in args
        (GOOD.replace("max_num_seqs: 32", "platform: cuda"),
         ["<fleet>:6:", "replicas[0].args.platform", "not in args"]),
        # no replicas; not a mapping; not YAML
        ("model: x\nreplicas: []\n", ["<fleet>:2:", "replicas", "at least 1"]),
        ("- 1\n- 2\n", ["<fleet>:1:", "expected a mapping"]),
        ("replicas: [\n  {platform: cpu\n", ["<fleet>:", "not valid YAML"]),
    ],
)  # fmt: skip
def test_invalid_files_name_the_line_and_field(text, where):
    with pytest.raises(FleetError) as e:
        parse_fleet(text)
    for part in where:
        assert part in str(e.value), (part, str(e.value))


def test_engine_checks_name_the_group(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text("replicas:\n  - {platform: cpu, args: {block_size: 12}}\n")
    fleet = load_fleet(f)
    with pytest.raises(FleetError, match=r"fleet.yaml: replicas\[0\] \(cpu\): block_size"):
        group_configs(fleet, EngineConfig(), str(f))
    with pytest.raises(FleetError, match="cannot read the fleet file"):
        load_fleet(tmp_path / "missing.yaml")


def test_serve_refuses_an_invalid_fleet_file_before_starting(tmp_path, caplog):
    from paged.cli.main import main

    f = tmp_path / "fleet.yaml"
    f.write_text("replicas:\n  - platform: cpu\n    count: 1\n    args: {max_num_sequences: 2}\n")
    assert main(["serve", "--fleet", str(f)]) == 2
    assert f"{f}:4: replicas[0].args.max_num_sequences: unknown engine argument" in caplog.text
