"""`taco_accel.Compression`: the one compression type, its spellings, JSON, errors, and the one default.

Single process: the spellings of "on" train an emulated tiny model to bit-identical losses (the
same collectives on the same values), every public entry resolves its default to "auto" (the
same constant everywhere), and the command lines map onto the same `Compression` as the API.
Two gloo ranks: a different compression for a model already parallelised raises on every rank.
"""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest
import torch

from harness import run_ranks

import taco_accel
from taco_accel import Compression, ConfigError, ConfigTypeError, TacoConfig, TacoError
from taco_accel.comm.policy import DEFAULT_COMPRESSION, DEFAULT_MODE
from taco_accel.models.tiny import tiny_model

G64 = TacoConfig(group_size=64)
RICH = Compression("on", forward=G64.replace(format="int8"), backward=None,
                   sites={"lm_head/*": None, "layers.0.*": TacoConfig(group_size=32)}, threshold_bytes=4096,
                   piece_bytes=2**20)


def _saved(tmp_path, values, name="c.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return path


def test_resolve_forms(tmp_path):
    assert Compression.resolve(RICH) is RICH
    for mode in ("auto", "on", "off"):
        assert Compression.resolve(mode) == Compression(mode)
    assert Compression.resolve(None) == Compression("off")
    assert Compression.resolve(G64) == Compression("on", G64, G64)
    assert Compression.resolve({"group_size": 64}) == Compression("on", G64, G64)  # TacoConfig fields alone
    assert Compression.resolve({"mode": "on", "forward": {"format": "int8", "group_size": 64}, "backward": None,
                                "sites": {"lm_head/*": None, "layers.0.*": {"group_size": 32}},
                                "threshold_bytes": 4096, "piece_bytes": 2**20}) == RICH
    assert Compression.resolve({}) == Compression() == Compression.resolve("auto")
    path = _saved(tmp_path, RICH.to_dict())
    assert Compression.resolve(str(path)) == RICH == Compression.resolve(path)  # a str ending in .json, a Path
    assert Compression.resolve({"forward": G64, "backward": G64, "mode": "auto"}) == Compression("auto", G64, G64)
    floor = Compression.resolve({"group_size": 64, "threshold_bytes": 4096})  # fields alone, with the floor
    assert floor == Compression("on", G64, G64, threshold_bytes=4096)


def test_json_round_trip(tmp_path):
    values = RICH.to_dict()
    assert json.loads(json.dumps(values)) == values  # JSON-ready
    assert Compression.from_dict(values) == RICH
    assert Compression.from_json(_saved(tmp_path, values)) == RICH
    assert values["mode"] == "on" and values["backward"] is None and values["sites"]["lm_head/*"] is None
    assert Compression.from_dict(Compression().to_dict()) == Compression()


def test_removed_auto_flag_and_moved_policy_fields_name_the_fix():
    """``auto=`` is gone (``mode`` says it); the floor and the piece size are `Compression`'s, not the codec's."""
    for value in (True, False):
        with pytest.raises(ConfigError, match=r"Compression\(auto=.*\) was removed: pass mode='auto'"):
            Compression(forward=G64, auto=value)
    with pytest.raises(ConfigError, match="the key 'auto' was removed"):
        Compression.resolve({"forward": {"group_size": 64}, "auto": True})
    for name in ("threshold_bytes", "piece_bytes"):
        for moved in (lambda: TacoConfig(**{name: 0}), lambda: G64.replace(**{name: 0}),
                      lambda: TacoConfig.from_dict({"group_size": 64, name: 0}),
                      lambda: Compression.resolve({"forward": {name: 0}})):
            with pytest.raises(ConfigError, match=rf"compression policy, not codec settings; pass "
                                                  rf"taco_accel.Compression\(\.\.\., {name}=\.\.\.\)"):
                moved()


@pytest.mark.parametrize("field", ["threshold_bytes", "piece_bytes"])
def test_policy_sizes_are_validated(field):
    assert getattr(Compression(**{field: 4096}), field) == 4096
    for value in (-1, 1.5, True, "8MiB", None):
        with pytest.raises(ConfigError, match=rf"Compression.{field}=.* must be an int >= 0 \(bytes\)"):
            Compression(**{field: value})


@pytest.mark.parametrize(("value", "error", "message"), [
    (42, ConfigTypeError, r"compression=42 \(int\) is not supported; pass a taco_accel.Compression, 'auto'"),
    (True, ConfigTypeError, "for a switch, pass 'on' or 'off'"),
    ("fp8", ConfigError, "compression='fp8' is not supported; pass 'auto', 'on', 'off' or the path of a .json file"),
    ("nowhere.json", ConfigError, "'nowhere.json' does not exist or is not a regular file"),
    ({"mode": "fast"}, ConfigError, r"Compression.mode='fast' is not supported; use one of \('auto', 'on', 'off'\)"),
    ({"fwd": {}}, ConfigError, r"unknown keys \['fwd'\]; a compression dict has 'mode'"),
    ({"mode": "on", "group_size": 64}, ConfigError, r"unknown keys \['group_size'\]"),
    ({"forward": {"group_size": 3}}, ConfigError, r"compression\['forward'\]: TacoConfig.group_size=3"),
    ({"forward": "e4m3"}, ConfigTypeError, r"compression\['forward'\]='e4m3' must be a TacoConfig, a dict"),
    ({"sites": ["lm_head/*"]}, ConfigTypeError, r"compression\['sites'\]=\['lm_head/\*'\] must be a dict"),
    ({"sites": {"x/*": {"codec": 1}}}, ConfigError, r"compression\['sites'\]\['x/\*'\]: unknown TacoConfig fields"),
], ids=["int", "bool", "word", "missing_file", "mode", "key", "mixed_keys", "field", "type", "sites",
        "site_field"])
def test_bad_values_name_themselves_and_the_fix(value, error, message):
    with pytest.raises(error, match=message) as raised:
        Compression.resolve(value)
    assert isinstance(raised.value, TacoError) and isinstance(raised.value, (ValueError, TypeError))


def test_bad_fields_and_files(tmp_path):
    with pytest.raises(ConfigTypeError, match=r"Compression.forward='e4m3' must be a TacoConfig or None"):
        Compression(forward="e4m3")
    with pytest.raises(ConfigTypeError, match="key 3 must be a str pattern"):
        Compression(sites={3: None})
    broken = tmp_path / "broken.json"
    broken.write_text("{mode: on")
    with pytest.raises(ConfigError, match=r"broken.json: not JSON .*write an object such as"):
        Compression.from_json(broken)
    with pytest.raises(ConfigError, match=r"l.json: expected a JSON object, got a list"):
        Compression.resolve(_saved(tmp_path, ["on"], "l.json"))
    with pytest.raises(ConfigError, match=r"compression file .*m.json: Compression.mode='of'"):
        Compression.resolve(_saved(tmp_path, {"mode": "of"}, "m.json"))


def _entries():
    """Every public entry that takes ``compression``: (name, function, a call that reaches the resolve)."""
    from transformers import Trainer

    from taco_accel.parallel import distribute
    from taco_accel.parallel.tensor_parallel import apply_tp
    from taco_accel.training import FinetuneConfig, TrainConfig

    model = torch.nn.Linear(2, 2)
    return {
        "parallelize": (taco_accel.parallelize, lambda c: taco_accel.parallelize(model, compression=c)),
        "from_pretrained": (taco_accel.from_pretrained, lambda c: taco_accel.from_pretrained("/no/such/dir", compression=c)),
        "distribute": (distribute, lambda c: distribute(model, None, None, compression=c)),
        "apply_tp": (apply_tp, lambda c: apply_tp(model, None, compression=c)),
        "Accelerator": (taco_accel.Accelerator.__init__, lambda c: taco_accel.Accelerator(compression=c)),
        "taco_trainer": (taco_accel.taco_trainer, lambda c: taco_accel.taco_trainer(Trainer, compression=c)),
        "TrainConfig": (TrainConfig, lambda c: TrainConfig(compression=c)),
        "FinetuneConfig": (FinetuneConfig, lambda c: FinetuneConfig(compression=c)),
    }


@pytest.mark.parametrize("entry", ["parallelize", "from_pretrained", "distribute", "apply_tp", "Accelerator",
                                   "taco_trainer", "TrainConfig", "FinetuneConfig"])
def test_every_entry_defaults_to_auto_and_resolves(entry):
    function, call = _entries()[entry]
    default = inspect.signature(function).parameters["compression"].default
    assert Compression.resolve(default).mode == "auto" and Compression.resolve(default) == Compression()
    with pytest.raises(ConfigTypeError, match=r"compression=<object"):  # resolved first, before any other work
        call(object())


def _losses(compression, steps: int = 2) -> tuple[list[str], int]:
    """Losses (exact, as hex) of an emulated tp=2 tiny Qwen2 over ``steps`` SGD steps, and how many
    of its collectives were compressed."""
    model = taco_accel.parallelize(tiny_model("qwen2"), tp=2, compression=compression, emulate=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item().hex())
    return losses, sum(s.compressed_calls for s in model.taco.sites.pop_stats().values())


def test_every_spelling_of_on_trains_alike(tmp_path):
    path = _saved(tmp_path, {"mode": "on"})
    spellings = {"on": "on", "TacoConfig()": TacoConfig(), "Compression('on')": Compression("on"),
                 "dict": {"mode": "on"}, "fields": {"group_size": 128}, "json str": str(path), "json Path": path,
                 "round trip": Compression.from_dict(Compression("on").to_dict())}
    on, compressed = _losses("on")
    assert compressed > 0  # "on" really compresses: every site, every message
    for name, spelling in spellings.items():
        assert _losses(spelling) == (on, compressed), name
    off, plain = _losses("off")
    assert plain == 0 and off != on  # the codec's rounding shows in the losses
    # auto on an emulated model: the size rule (UNTIMED_BYTES = 8 MiB); a tiny model's messages stay plain
    assert _losses("auto") == (off, 0) == _losses(None)


# -- one default, one mapping from the command line, one compression per model -----------------

def test_every_entry_has_the_one_default():
    """Every entry that takes ``compression`` defaults to the one constant (``"auto"``), pipeline
    boundaries in one process included; the command lines' default is the same mode."""
    from taco_accel.parallel import apply_pp, emulate_boundaries
    from taco_accel.training.cli import build_parser

    functions = {name: function for name, (function, _) in _entries().items()}
    functions.update(apply_pp=apply_pp, emulate_boundaries=emulate_boundaries, resolve=Compression.resolve)
    for name, function in functions.items():
        assert inspect.signature(function).parameters[
            "value" if name == "resolve" else "compression"].default is DEFAULT_COMPRESSION, name
    assert DEFAULT_COMPRESSION == DEFAULT_MODE == Compression().mode == "auto"
    args = build_parser("qwen2", "test").parse_args(["--preset", "small"])
    assert args.compression is None and _cli(["--preset", "small"], 512) == Compression(DEFAULT_MODE)


def _cli(argv, hidden, parser="pretrain"):
    from taco_accel.training import cli, finetune_cli

    if parser == "pretrain":
        return cli.compression_from_args(cli.build_parser("qwen2", "test").parse_args(argv), hidden)
    return cli.compression_from_args(finetune_cli.build_parser("qwen2", "test").parse_args(argv), hidden, small=False)


@pytest.mark.parametrize("parser", ["pretrain", "finetune"])
def test_command_line_maps_onto_the_same_compression(tmp_path, parser):
    """Each flag is one field or method of `Compression`: what a command line builds equals the
    API value spelled with the same words, for a model of hidden size 128 or more (where the one
    fitting rule, `Compression.fit`, changes nothing)."""
    path = _saved(tmp_path, RICH.to_dict())
    cases = {
        ("--compression", "on"): Compression("on"),
        ("--compression", "off"): Compression("off"),
        ("--compression", "auto", "--compression-threshold", "4096"): Compression("auto", threshold_bytes=4096),
        ("--compression", "on", "--group-size", "64"): Compression("on", G64, G64),
        ("--compression", str(path)): RICH,
        ("--compression", str(path), "--group-size", "64", "--compression-threshold", "0"):
            RICH.map_configs(lambda c: c.replace(group_size=64)).replace(threshold_bytes=0),
    }
    for argv, api in cases.items():
        for hidden in (128, 4096):
            assert _cli(list(argv), hidden, parser) == api, (argv, hidden)
    # below 128 the rule fits the group size unless --group-size says it; the API applies the same rule by name
    assert _cli(["--compression", "on"], 64, parser) == Compression("on").fit(64) == Compression("on", G64, G64)
    assert _cli(["--compression", "on", "--group-size", "128"], 64, parser) == Compression("on")


def test_fit_is_one_rule():
    assert Compression("on").fit(128) == Compression("on") and Compression("on").fit(32).forward.group_size == 32
    assert Compression("on").fit(48).backward.group_size == 32  # the largest power of two <= h
    assert Compression("on").fit(16).forward.group_size == 32  # the codec's smallest group
    narrow = Compression("auto", G64.replace(group_size=32), None, {"lm_head/*": TacoConfig(group_size=256)})
    assert narrow.fit(64) == Compression("auto", TacoConfig(group_size=32), None, {"lm_head/*": G64})


def test_the_default_is_told_apart_from_a_given_auto():
    from taco_accel.comm.policy import check_same

    default = Compression.resolve(DEFAULT_COMPRESSION)
    assert default.defaulted and default == Compression() and not Compression.resolve("auto").defaulted
    on = Compression("on")
    check_same(default, on, "here")  # nothing given: the model keeps its own
    check_same(Compression.resolve("on"), on, "here")  # the same value
    with pytest.raises(ConfigError, match=r"here: compression=auto .* already parallelised with compression=on"):
        check_same(Compression.resolve("auto"), on, "here")


def _conflicting_compression() -> dict:
    """A tiny model made tensor parallel with "on", then handed to each entry with another
    compression (each must raise before any collective, on every rank), and with the same one."""
    from accelerate import ParallelismConfig

    from taco_accel.parallel import ParallelDims, apply_pp, apply_tp, build_mesh, distribute

    dims = ParallelDims(tp=2)
    mesh = build_mesh(dims, "cpu")
    model = tiny_model("qwen2")
    apply_tp(model, mesh, compression="on")
    calls = {
        "distribute": lambda c: distribute(model, mesh, dims, compression=c),
        "apply_pp": lambda c: apply_pp(model, mesh, compression=c),
        "Accelerator": lambda c: taco_accel.Accelerator(parallelism_config=ParallelismConfig(tp_size=2),
                                                        compression=c).prepare(model),
    }
    out = {}
    for name, call in calls.items():
        try:
            call("off")
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    out["same"] = type(distribute(model, mesh, dims, compression=Compression("on"))).__name__  # equal: accepted
    return out


def test_a_conflicting_compression_raises_on_every_rank():
    for rank in run_ranks(_conflicting_compression, 2):
        for name in ("distribute", "apply_pp", "Accelerator"):
            assert rank[name] is not None, (name, rank)  # a ConfigError, not silently ignored
            assert "compression=off was given for a model already parallelised with compression=on (fwd" in rank[name]
            assert "pass the same value (or none)" in rank[name]
        assert rank["same"] == "ModelParts"
