"""The layer in a process leaves plain pamqp, aio-pika and pika as they ship.

Two processes run ``tests/codec_probe.py`` against the test brokers: one never imports
the layer, the other imports it and keeps both layer faces connected and working while
plain aio-pika and pika connections publish and read every field type.  What the plain
libraries encode (bytes), decode (values) and refuse (the error's name), offline and on
the wire, must be the same in both; the layer's own clients keep their codec (a float
header comes back as the same double on both faces); no logger's level or root handler
changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe(mode: str, url: str) -> dict:
    queue = f"codec-probe-{mode}-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-m", "tests.codec_probe", mode, url, queue],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plain_clients_encode_and_decode_as_without_the_layer(brokers) -> None:
    url = brokers.urls[0]
    bare, layer = _probe("bare", url), _probe("layer", url)
    assert layer["after_import"] == bare["offline"]  # importing changes nothing
    assert layer["offline"] == bare["offline"]  # nor do the layer's live connections
    assert layer["wire"] == bare["wire"]
    # the probe reached every kind of outcome: bytes, decoded values and refusals
    assert "raises" in bare["offline"]["pamqp.encode.bytes"]
    assert bare["offline"]["pamqp.decode.single"] == "(11, {'f': 0.10000000149011612})"
    assert bare["wire"]["pika.get.5"] == "{'float': 0L}"  # pika's own reading of a double
    for face in ("async", "sync"):  # the layer's codec, inside the layer only
        assert "'f': 0.1" in layer["layer"][f"layer.{face}"]
        assert "'f': 0.1" in layer["layer_still"][f"layer.{face}"]
    assert layer["loggers_unchanged"] and layer["root_handlers_unchanged"]
