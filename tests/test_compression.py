"""`taco_accel.Compression`: the one compression type, its spellings, JSON, errors, and the one default.

Single process: the spellings of "on" train an emulated tiny model to bit-identical losses (the
same collectives on the same values), and every public entry resolves its default to "auto".
"""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest
import torch

import taco_accel
from taco_accel import Compression, ConfigError, ConfigTypeError, TacoConfig, TacoError
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
