"""Settings are written once: every ``pdserve router|prefill|decode|registry|planner`` flag is generated from a field of
that service's settings (``pdserve/shared/settings.py``), one flag per field and one field per flag, with the field's
description as help; ``pdserve up`` forwards the engine settings with the flags of the fields that read them."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pdserve.services.decode.main import command as decode_command
from pdserve.services.decode.settings import DecodeSettings
from pdserve.services.planner.main import command as planner_command
from pdserve.services.planner.settings import PlannerSettings
from pdserve.services.prefill.main import command as prefill_command
from pdserve.services.prefill.settings import PrefillSettings
from pdserve.services.registry.main import command as registry_command
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.router.main import command as router_command
from pdserve.services.router.settings import RouterSettings
from pdserve.services.up import FORWARDED, UpOptions, command as up_command
from pdserve.shared.settings import given

COMMANDS = {"router": (router_command, RouterSettings), "prefill": (prefill_command, PrefillSettings),
            "decode": (decode_command, DecodeSettings), "registry": (registry_command, RegistrySettings),
            "planner": (planner_command, PlannerSettings)}

WORKER = ("--host --port --pod-id --advertise-host --redis-url --registry-url --registry-token --kv-transfer-secret "
          "--model --dtype --block-size --max-model-len --max-num-seqs --max-num-batched-tokens --enable-prefix-caching "
          "--kv-cache-memory --attention-backend --device --engine-stall-s --log-level ")
# The flags each command had when they were written by hand: every one must still exist, spelled the same.
EARLIER_FLAGS = {
    "router": "--host --port --model --served-model-name --redis-url --registry-url --api-key --cache-salt-per-api-key "
              "--enable-prompt-tokens-details --registry-token --max-body-bytes --max-model-len "
              "--local-prefill-threshold --local-prefill-fallback-max-tokens --prefill-stall-s --routing-mode "
              "--routing-load-weight --routing-temperature --max-concurrent-requests --request-timeout-s "
              "--migration-stall-s --max-migrations --max-queued-requests --max-prompts-per-request --sse-ping-s "
              "--http-header-timeout-s --http-body-timeout-s --http-keep-alive-s --max-queued-prompt-tokens "
              "--shutdown-grace-s --log-level",
    "registry": "--host --port --redis-url --pod-ttl-s --auth-token --log-level",
    "prefill": WORKER + "--max-inflight --claim-idle-s --kv-wait-timeout-s --kv-transfer-timeout-s "
                        "--kv-unreachable-cooldown-s --max-waiting-kv-bytes",
    "decode": WORKER + "--kv-port --colocated --speculative-config --lease-ttl-s --handover-memory-s",
    "planner": "--host --port --redis-url --namespace --prefill-deployment --decode-deployment --router-deployment "
               "--interval-seconds --ttft-slo-seconds --tpot-slo-seconds --target-kv-cache-usage --prefill-min-replicas "
               "--prefill-max-replicas --decode-min-replicas --decode-max-replicas --dry-run --log-level",
}


def options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_settings_field_has_exactly_one_flag_and_every_flag_a_field(name):
    command, settings_cls = COMMANDS[name]
    names = [o.name for o in options(command)]
    assert sorted(names) == sorted(settings_cls.model_fields) and len(names) == len(set(names))
    for option in options(command):
        field = settings_cls.model_fields[option.name]
        dashed = option.name.replace("_", "-")
        assert option.opts == [f"--{dashed}"]
        assert option.secondary_opts == ([f"--no-{dashed}"] if option.is_flag else [])
        assert option.default is None  # unset flags leave the value to PDSERVE_* variables and the default
        assert field.description and option.help.startswith(field.description), option.name


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_hand_written_flags_kept_their_names(name):
    flags = {flag for option in options(COMMANDS[name][0]) for flag in option.opts + option.secondary_opts}
    assert set(EARLIER_FLAGS[name].split()) <= flags


def parse(command: click.Command, args: list[str]) -> dict:
    with command.make_context(command.name, args) as ctx:
        return given(ctx.params)


def test_flags_become_settings_and_variables_fill_in_the_rest(monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_QUEUED_REQUESTS", "7")
    monkeypatch.setenv("PDSERVE_ROUTING_MODE", "least_loaded")
    monkeypatch.setenv("PDSERVE_OUTPUT_KEEPALIVE_S", "1")  # the bound must be at least twice the keep-alives'
    flags = parse(router_command, ["--routing-mode", "round_robin", "--no-cache-salt-per-api-key",
                                   "--request-timeout-s", "2.5", "--registry-token", "t0ken"])
    settings = RouterSettings(**flags)
    assert (settings.routing_mode, settings.cache_salt_per_api_key, settings.request_timeout_s) == (
        "round_robin", False, 2.5)
    assert settings.max_queued_requests == 7 and settings.registry_token.get_secret_value() == "t0ken"
    monkeypatch.setenv("PDSERVE_REGISTRY_TOKEN", "x" * 24)
    assert RegistrySettings(**parse(registry_command, [])).auth_token.get_secret_value() == "x" * 24
    decode = DecodeSettings(**parse(decode_command, ["--colocated", "--max-num-seqs", "3", "--kv-port", "9100"]))
    assert (decode.colocated, decode.max_num_seqs, decode.kv_port, decode.enable_prefix_caching) == (True, 3, 9100, True)


def test_help_names_the_variable_and_the_default_and_bounds_are_checked_by_the_flag():
    help_text = {o.name: o.help for o in options(prefill_command)}
    assert help_text["claim_idle_s"] == "Take over entries idle this long (s). [PDSERVE_CLAIM_IDLE_S, default 60]"
    assert help_text["redis_url"].endswith("[PDSERVE_REDIS_URL or REDIS_URL, default redis://127.0.0.1:6379/0]")
    assert help_text["max_model_len"].endswith("[PDSERVE_MAX_MODEL_LEN]")  # no default shown for None
    result = CliRunner().invoke(router_command, ["--max-body-bytes", "0"])
    assert result.exit_code == 2 and "--max-body-bytes" in result.output and "x>=1" in result.output


def test_up_forwards_engine_settings_with_the_flags_of_their_fields():
    by_name = {o.name: o for o in options(up_command)}
    for settings_cls, name in FORWARDED:
        option, field = by_name[name], settings_cls.model_fields[name]
        assert option.opts == [f"--{name.replace('_', '-')}"] and option.help.startswith(field.description)
        worker_option = next(o for c, s in COMMANDS.values() if s is settings_cls or issubclass(s, settings_cls)
                             for o in options(c) if o.name == name)
        assert repr(option.type) == repr(worker_option.type)
    own = {f for f in UpOptions.__dataclass_fields__ if f != "engine"}
    assert set(by_name) == own | {name for _, name in FORWARDED}


def test_the_decode_lease_outlives_the_routers_prefill_stall_check_by_construction(monkeypatch):
    """The lease is derived from --prefill-stall-s, and a lease set at or above stall + margin is taken while one
    below it is refused with one clear line, by the decode worker's flags and by ``pdserve up`` before it starts
    anything."""
    from pdserve.services.decode.main import command as decode_command
    from pdserve.services.decode.settings import LEASE_MARGIN_S, DecodeSettings

    for name in ("PDSERVE_PREFILL_STALL_S", "PDSERVE_LEASE_TTL_S"):
        monkeypatch.delenv(name, raising=False)
    assert (DecodeSettings().prefill_stall_s, DecodeSettings().lease_ttl_s) == (30.0, 30.0 + LEASE_MARGIN_S)
    assert DecodeSettings(prefill_stall_s=4).lease_ttl_s == 30.0
    assert DecodeSettings(prefill_stall_s=45).lease_ttl_s == 45.0 + LEASE_MARGIN_S
    assert DecodeSettings(prefill_stall_s=0, lease_ttl_s=1).lease_ttl_s == 1.0  # the routers never move one
    assert DecodeSettings(prefill_stall_s=30, lease_ttl_s=30 + LEASE_MARGIN_S).lease_ttl_s == 40.0  # the boundary
    want = ("--lease-ttl-s 39.9 must be at least --prefill-stall-s 30 + 10 = 40 s: a prefill worker stopped while "
            "it holds a KV reservation would fail its request when the lease expires before the router moves the "
            "request; raise PDSERVE_LEASE_TTL_S or lower PDSERVE_PREFILL_STALL_S (leave the lease unset to derive "
            "it)")
    result = CliRunner().invoke(decode_command, ["--prefill-stall-s", "30", "--lease-ttl-s", "39.9"])
    assert result.exit_code == 1 and result.output.strip() == f"Error: {want}", result.output
    monkeypatch.setenv("PDSERVE_PREFILL_STALL_S", "30")  # what the router and the workers read alike
    result = CliRunner().invoke(up_command, ["--lease-ttl-s", "39.9", "--no-router"])
    assert result.exit_code == 1 and result.output.strip().endswith(want), result.output
