"""The router refuses, with one line at start-up, a silence bound (``--request-timeout-s``) shorter than twice the
workers' keep-alive interval (``PDSERVE_OUTPUT_KEEPALIVE_S``): a waiting request is silent for up to 1.5x that
interval, so such a bound ends requests that are well (issue: 7 of 8 streams got 504 at 8 s against 5 s).
``pdserve router`` and ``pdserve up`` (before anything starts) both say so; twice the interval is accepted."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pdserve.services.router.main import command as router_command
from pdserve.services.router.settings import RouterSettings
from pdserve.services.up import command as up_command
from support.redis_server import free_port

LINE = ("Error: --request-timeout-s 8 is less than twice the workers' keep-alive interval (--output-keepalive-s 5): "
        "requests that only wait would end with 504; raise the timeout to at least 10 s or lower "
        "PDSERVE_OUTPUT_KEEPALIVE_S\n")
pytestmark = pytest.mark.timeout(30)  # a router that is not refused would serve until killed

SHORT = {"PDSERVE_REQUEST_TIMEOUT_S": "8", "PDSERVE_OUTPUT_KEEPALIVE_S": "5"}


@pytest.mark.parametrize("command,args", [(router_command, ["--port", str(free_port())]), (up_command, ["--port", str(free_port())])],
                         ids=["router", "up"])
def test_a_bound_shorter_than_twice_the_keepalive_interval_is_refused_in_one_line(command, args):
    result = CliRunner().invoke(command, args, env=SHORT)
    assert result.exit_code == 1
    assert result.output == LINE


def test_the_flag_is_refused_like_the_variable():
    result = CliRunner().invoke(router_command, ["--request-timeout-s", "8", "--output-keepalive-s", "5"])
    assert (result.exit_code, result.output) == (1, LINE)


def test_twice_the_interval_is_accepted_and_the_default_bound_covers_the_default_interval():
    assert RouterSettings(request_timeout_s=10, output_keepalive_s=5).request_timeout_s == 10
    assert RouterSettings(request_timeout_s=8, output_keepalive_s=2).output_keepalive_s == 2  # the command
    defaults = RouterSettings()
    assert defaults.request_timeout_s >= 2 * defaults.output_keepalive_s
    with pytest.raises(ValueError, match="less than twice"):
        RouterSettings(request_timeout_s=9.9, output_keepalive_s=5)
