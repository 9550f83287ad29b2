"""The run's hash covers the round's configs (protocol/config.py): every field is hashed or listed as local."""

import dataclasses
import math

from phalanx.protocol.config import LOCAL_FIELDS, Codec, RoundConfig, VerifyConfig, protocol_fields

BASE = RoundConfig(aggregator="centered_clip", aggregator_params=(("tau", 1.0),), verify=VerifyConfig(tau=1.0))

# one other legal value for every field, by dotted name (a new field needs one here)
CHANGES = {
    "matchmaking.min_group_size": 2,
    "matchmaking.target_group_size": 4,
    "matchmaking.matchmaking_timeout_s": 7.0,
    "matchmaking.join_timeout_s": 90.0,
    "matchmaking.lockstep": False,
    "matchmaking.window_s": 0.5,
    "matchmaking.group_size": 4,
    "aggregator": "median",
    "aggregator_params": (("tau", 2.0),),
    "compression": Codec.FP16,
    "allreduce_timeout_s": 40.0,
    "part_idle_timeout_s": 9.0,
    "state_timeout_s": 300.0,
    "state_donors": 1,
    "verify.tau": 2.0,
    "verify.eps": 1e-7,
    "verify.phase_timeout_s": 20.0,
    "verify.validators": 2,
    "verify.contribution_rtol": 1e-3,
    "verify.validators_sit_out": True,
}


def _leaves(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, prefix + f.name + ".")
        else:
            yield prefix + f.name


def _changed(config, dotted, value):
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: _changed(getattr(config, head), rest, value)})


def test_every_field_is_hashed_or_local():
    assert set(_leaves(BASE)) == set(CHANGES), "give each new field of the round's configs a value in CHANGES"
    assert LOCAL_FIELDS <= set(CHANGES)
    base = protocol_fields(BASE)
    for dotted, value in CHANGES.items():
        changed = protocol_fields(_changed(BASE, dotted, value))
        fingerprint = _changed(BASE, dotted, value).fingerprint()
        if dotted in LOCAL_FIELDS:
            assert changed == base, f"{dotted} is listed as local but reaches the hash"
            assert fingerprint == BASE.fingerprint(), f"{dotted} is listed as local but reaches the fingerprint"
        else:
            assert changed != base, f"{dotted} is protocol-relevant but left out of protocol_fields (or list it in LOCAL_FIELDS)"
            assert fingerprint != BASE.fingerprint(), f"{dotted} is protocol-relevant but left out of the fingerprint"


def test_group_sizes_and_verification_are_hashed_by_name():
    fields = protocol_fields(BASE)
    assert fields["matchmaking.min_group_size"] == 1 and fields["matchmaking.target_group_size"] is None
    assert fields["verify.phase_timeout_s"] == 10.0 and fields["compression"] == "none"
    assert protocol_fields(RoundConfig())["verify"] is None
    assert not LOCAL_FIELDS & set(fields)


def test_unverified_and_verified_mean_differ():
    plain = protocol_fields(RoundConfig())
    verified = protocol_fields(RoundConfig(verify=VerifyConfig(tau=math.inf, eps=0.0)))
    assert plain != verified


def test_each_change_differs_from_the_base():
    """Else a local field's check above would pass for nothing."""
    for dotted, value in CHANGES.items():
        head, _, rest = dotted.partition(".")
        current = getattr(getattr(BASE, head), rest) if rest else getattr(BASE, head)
        assert current != value, dotted


def test_fingerprint_depends_on_values_not_on_objects():
    again = RoundConfig(aggregator="centered_clip", aggregator_params=(("tau", 1.0),), verify=VerifyConfig(tau=1.0))
    assert again.fingerprint() == BASE.fingerprint() and len(BASE.fingerprint()) == 64
