"""Validators that check each DHT record once (lightning_swarm/record_validators.py): the same bytes pass again
without the work, anything else is checked in full, and a merged schema makes them check everything again."""

from __future__ import annotations

import dataclasses

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from lightning_swarm.record_validators import CachedSchemaValidator, CachedSignatureValidator


def signed_record(validator: RSASignatureValidator, value: bytes, expiration: float) -> DHTRecord:
    record = DHTRecord(key=DHTID.generate(source="run_progress").to_bytes(), subkey=validator.local_public_key,
                       value=value, expiration_time=expiration)
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_a_signed_record_is_verified_once_and_an_altered_one_every_time():
    validator = CachedSignatureValidator(RSAPrivateKey())
    record = signed_record(validator, b"progress", get_dht_time() + 60)
    assert validator.validate(record) and validator.validate(record) and validator.validate(record)
    assert (validator.checked, validator.recalled) == (1, 2)
    altered = dataclasses.replace(record, value=record.value.replace(b"progress", b"pr0gress"))
    assert not validator.validate(altered) and not validator.validate(altered)
    assert validator.checked == 3  # a refused record is never remembered
    # a new expiration time is a new record: its signature no longer matches
    assert not validator.validate(dataclasses.replace(record, expiration_time=record.expiration_time + 1))
    # a stranger's record (another key) is checked on its own
    stranger = RSASignatureValidator(RSAPrivateKey())
    assert validator.validate(signed_record(stranger, b"progress", get_dht_time() + 60))
    assert validator.checked == 5


def test_the_table_is_bounded():
    validator = CachedSignatureValidator(RSAPrivateKey(), remembered=2)
    records = [signed_record(validator, f"v{i}".encode(), get_dht_time() + 60) for i in range(3)]
    for record in records:
        assert validator.validate(record)
    assert validator.validate(records[2]) and validator.validate(records[1]) and validator.recalled == 2
    assert validator.validate(records[0]) and validator.checked == 4  # the oldest was forgotten
    with pytest.raises(ValueError, match="remembered"):
        CachedSignatureValidator(RSAPrivateKey(), remembered=0)


class First(pydantic.BaseModel):
    first: pydantic.StrictInt


class Second(pydantic.BaseModel):
    second: pydantic.StrictInt


def schema_record(field: str, value) -> DHTRecord:
    return DHTRecord(key=DHTID.generate(source=f"run_{field}").to_bytes(), subkey=DHTProtocol.IS_REGULAR_VALUE,
                     value=DHTProtocol.serializer.dumps(value), expiration_time=get_dht_time() + 60)


def test_a_merged_schema_makes_it_check_again_what_it_accepted():
    validator = CachedSchemaValidator(First, prefix="run")
    unknown_yet = schema_record("second", "not an int")
    assert validator.validate(unknown_yet)  # a key no schema knows: allowed (hivemind's allow_extra_keys)
    assert validator.validate(schema_record("first", 3)) and not validator.validate(schema_record("first", "3"))
    composite = CompositeValidator([validator])
    composite.extend([SchemaValidator(Second, prefix="run")])  # as hivemind's tracker adds its own later
    assert not validator.validate(unknown_yet)  # now its schema is known: checked again, and refused
    assert validator.validate(schema_record("second", 4))


def test_behind_hiveminds_composite_with_the_trackers_validator_a_record_is_recalled():
    key = RSAPrivateKey()
    ours = CachedSignatureValidator(key)
    composite = CompositeValidator([ours])
    composite.extend([RSASignatureValidator(key)])
    record = signed_record(ours, b"x", get_dht_time() + 60)
    assert composite.validate(record) and composite.validate(record) and ours.recalled == 1
