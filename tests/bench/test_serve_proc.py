"""bench.serve_proc.serve_endpoints: a real ``pdserve serve`` with its OpenAI front door on a free port."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from bench.serve_proc import serve_endpoints


def test_serve_endpoints_yields_a_live_openai_base_url_and_stops_it():
    with serve_endpoints(["--served-model-name", "tiny", "--decode-weights", "model"]) as ends:
        assert ends.grpc.startswith("127.0.0.1:") and ends.http.startswith("http://127.0.0.1:")
        assert ends.http.endswith("/v1")
        with urllib.request.urlopen(ends.http + "/models", timeout=30) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny"]
    with pytest.raises(urllib.error.URLError):  # the whole process group is gone
        urllib.request.urlopen(ends.http + "/models", timeout=5)
