"""The churn soak at CI's size (kvmap.tools.churn; the full 2,000-peer run
is ``python -m kvmap.tools.churn --peers 2000``): 200 decode daemons, 4 at
a time, each on a fresh node of a test bed, pull verified bytes from one
owner over UCX on TCP and leave, killed, stopped, with their link gone,
or cut mid-pull. The owner must live, serve every pull of a live peer,
and end within 64 MiB of RSS and 64 fds of where it began, holding no
lease and no more remote agents. Peers whose link went down never close
their connections: the owner's keepalive (peer_keepalive_s) must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmap.tools.churn import DEPARTURES, Churn, ChurnConfig, verdict
from kvmap.tools.netbed import NetBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_two_hundred_peers_come_and_go_and_the_owner_ends_where_it_began(
    bed: NetBed, tmp_path: Path
) -> None:
    """Every soak goal holds (``churn.verdict`` lists none missed), each way of leaving was
    taken 40 times, and every pull of a live peer loaded verified bytes."""
    config = ChurnConfig(peers=200, at_once=4, settle_s=120.0)
    report = Churn(config, tmp_path).run(bed, progress=print)
    figures = report.figures()
    print(json.dumps(figures, indent=2))
    assert verdict(report) == []
    assert report.departures == {d: 40 for d in DEPARTURES}
    assert report.pulls_ok == 200 * config.pulls
    assert report.owner_alive and not report.owner_log_fatal
