"""scry.hba: pg_hba.conf-format rules, parsed and matched without sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from scry.hba import HbaError, HbaRules, load_hba, parse_hba

RULES = """
# TYPE     DATABASE        USER          ADDRESS              METHOD
local      all             postgres                           peer
hostssl    all             tls_only      0.0.0.0/0            scram-sha-256
hostnossl  all             tls_only      all                  reject
host       "my db",app     app           127.0.0.1/32         md5
host       sameuser        all           10.1.0.0 255.255.0.0 password
host       all             "all"         192.168.0.0/16       trust   # a user named all
host       all             app,\\
                           other         ::1/128              scram-sha-256
host       all             blocked       all                  reject
host       all             all           127.0.0.0/8          scram-sha-256
"""


def decide(rules: HbaRules, host: str | None, database: str, user: str, *, tls: bool = False):
    method, rule = rules.method_for(
        local=host is None, tls=tls, host=host, database=database, user=user
    )
    return method, (rule.line if rule is not None else None)


@pytest.fixture
def rules() -> HbaRules:
    return HbaRules(parse_hba(RULES, "hba.conf"))


def test_the_first_matching_rule_decides(rules: HbaRules) -> None:
    assert decide(rules, "127.0.0.1", "app", "app") == ("md5", 6)
    assert decide(rules, "127.0.0.1", "my db", "app") == ("md5", 6)
    assert decide(rules, "127.0.0.1", "other", "app") == ("scram-sha-256", 12)
    assert decide(rules, "127.0.0.1", "app", "blocked") == ("reject", 11)
    assert decide(rules, None, "app", "postgres") == ("peer", 3)


def test_connection_types(rules: HbaRules) -> None:
    assert decide(rules, "203.0.113.9", "app", "tls_only", tls=True) == ("scram-sha-256", 4)
    assert decide(rules, "203.0.113.9", "app", "tls_only") == ("reject", 5)
    # local rules never match TCP, host rules never match the socket
    assert decide(rules, None, "app", "app") == ("reject", None)


def test_addresses_and_masks(rules: HbaRules) -> None:
    assert decide(rules, "10.1.200.3", "joe", "joe") == ("plain", 7)  # sameuser
    assert decide(rules, "10.1.200.3", "app", "joe") == ("reject", None)
    assert decide(rules, "10.2.0.1", "joe", "joe") == ("reject", None)
    assert decide(rules, "192.168.4.4", "app", "all") == ("trust", 8)  # quoted: a name
    assert decide(rules, "192.168.4.4", "app", "someone") == ("reject", None)
    assert decide(rules, "::1", "app", "other") == ("scram-sha-256", 9)  # continued line
    # An IPv4 client seen through an IPv6 socket matches IPv4 rules.
    assert decide(rules, "::ffff:127.0.0.1", "app", "app") == ("md5", 6)
    assert decide(rules, "fe80::1%eth0", "app", "app") == ("reject", None)


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("hostgssenc all all all md5", "connection type 'hostgssenc'"),
        ("host all all example.com md5", "host names"),
        ("host all all samehost md5", "host names, samehost"),
        ("host all all 10.0.0.1 md5", "not a netmask"),
        ("host all all 10.0.0.1", "expected TYPE DATABASE USER ADDRESS METHOD"),
        ("host all all all ident", "method 'ident' is not supported"),
        ("host all all all md5 clientcert=verify-full", "options after the method"),
        ("host all all all md5 map=staff", "map= is only for peer and cert, not md5"),
        ("local all all peer map=", "options after the method"),
        ("host all +admins all md5", "group names (+admins)"),
        ("host replication all all md5", "replication connections"),
        ("host all all all peer", "peer is only for local"),
        ("local all all", "expected TYPE DATABASE USER METHOD"),
        ('host "all all all md5', "unterminated quoted name"),
        ("host all ,,app all md5", "missing before ','"),
        ("host all @missing.txt all md5", "cannot read"),
    ],
)
def test_lines_scry_cannot_honour_are_refused_with_their_number(line: str, complaint: str) -> None:
    with pytest.raises(HbaError) as caught:
        parse_hba(f"# first\n\n{line}\n", "/etc/scry/hba.conf")
    assert "/etc/scry/hba.conf line 3" in str(caught.value)
    assert complaint in str(caught.value)


def test_name_files_are_read_beside_the_hba_file(tmp_path: Path) -> None:
    (tmp_path / "admins.txt").write_text("# who may\nalice, bob\ncarol\n")
    (tmp_path / "hba.conf").write_text("host all @admins.txt 127.0.0.1/32 trust\n")
    rules = load_hba(str(tmp_path / "hba.conf"))
    assert [decide(rules, "127.0.0.1", "app", u)[0] for u in ("alice", "bob", "carol", "dave")] == [
        "trust",
        "trust",
        "trust",
        "reject",
    ]


def test_quotes_keep_commas_spaces_and_quotes() -> None:
    (rule,) = parse_hba('host "a,b","say ""hi""" all all trust\n')
    assert rule.databases == frozenset({"a,b", 'say "hi"'}) and rule.all_users


def test_peer_and_cert_rules_may_name_a_user_name_map() -> None:
    peer, cert, plain = parse_hba(
        "local all all peer map=staff\nhostssl all all all cert map=certs\nhost all all all md5\n"
    )
    assert (peer.method, peer.user_map) == ("peer", "staff")
    assert (cert.method, cert.user_map) == ("cert", "certs")
    assert plain.user_map is None
