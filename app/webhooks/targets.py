"""Which URLs a webhook may point at (the SSRF guard, issue #34).

Only ``http`` and ``https``, no user info, no fragment. By default only public addresses are
targets: a host is resolved (at submission, and again before every attempt) and every address it
resolves to must be public -- not loopback, private (RFC 1918, ULA), link-local, CGNAT
(100.64/10), multicast, reserved, unspecified, documentation or benchmarking ranges, nor an IPv6
address that embeds such an IPv4 one (IPv4-mapped, IPv4-compatible, NAT64 64:ff9b::/96, 6to4,
Teredo). ``REV88_WEBHOOK_ALLOW_CIDRS`` adds ranges (a comma list: ``127.0.0.2/32,10.1.0.0/16``).
The request then goes to a checked address (``Target.addresses``), never to a second lookup of
the name, so a DNS answer that changes between the check and the connection cannot redirect it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_URL = 2048
NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4_NOT_GLOBAL_EXTRA = [ipaddress.ip_network(n) for n in ("100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15")]


class TargetRefused(ValueError):
    """A URL the service will not send to; the message names why (a 422 naming ``webhook``)."""


@dataclasses.dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str  # as written (lower case; an IPv6 literal without brackets)
    port: int
    path: str  # path and query, as written ("/" for none)
    addresses: tuple[str, ...] = ()  # checked, in the resolver's order

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def url_for(self, address: str) -> str:
        """The request URL aimed at one checked address (the Host header keeps the name)."""
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_allow(text: str | None) -> tuple[Network, ...]:
    """REV88_WEBHOOK_ALLOW_CIDRS -> networks; ValueError naming the bad entry."""
    out = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"REV88_WEBHOOK_ALLOW_CIDRS: {part!r} is not an address range like 203.0.113.0/24") from None
    return tuple(out)


def parse(url: str) -> Target:
    """The URL's parts, or TargetRefused naming what is wrong with it (no lookup here)."""
    if not isinstance(url, str) or not url:
        raise TargetRefused("webhook must be an http:// or https:// URL")
    if len(url) > MAX_URL:
        raise TargetRefused(f"webhook URL is {len(url)} characters long; at most {MAX_URL}")
    if any(c.isspace() or ord(c) < 0x21 or ord(c) == 0x7f for c in url):
        raise TargetRefused("webhook URL must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"webhook URL {url[:100]!r} cannot be parsed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise TargetRefused(f"webhook URL scheme must be http or https, got {parts.scheme or 'none'!r}")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("webhook URL must not carry user information (user:password@)")
    if parts.fragment:
        raise TargetRefused("webhook URL must not have a fragment (#...)")
    host = (parts.hostname or "").lower()
    if not host:
        raise TargetRefused("webhook URL has no host")
    if port == 0:
        raise TargetRefused("webhook URL port must be in 1..65535")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(url=url, scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80), path=path)


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if int(address) >> 32 == 0 and int(address) > 1:  # IPv4-compatible ::a.b.c.d (deprecated)
        return ipaddress.IPv4Address(int(address))
    return None


def why_not_public(address: Address) -> str | None:
    """None for a public unicast address; else what kind of address it is."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_v4(address)
        if embedded is not None:
            inner = why_not_public(embedded)
            return None if inner is None else f"an IPv6 address embedding {embedded}, {inner}"
        if address.scope_id:
            return "a scoped (link-local) address"
    for test, name in ((lambda a: a.is_unspecified, "unspecified"), (lambda a: a.is_loopback, "loopback"),
                       (lambda a: a.is_link_local, "link-local"), (lambda a: a.is_multicast, "multicast"),
                       (lambda a: a.is_private, "private"), (lambda a: a.is_reserved, "reserved")):
        if test(address):
            return f"{'an' if name[0] in 'aeiou' else 'a'} {name} address"
    if isinstance(address, ipaddress.IPv4Address) and any(address in n for n in _V4_NOT_GLOBAL_EXTRA):
        return "a shared or special-purpose address (CGNAT, IETF, benchmarking)"
    if not address.is_global:
        return "not a globally routable address"
    return None


def check_address(text: str, allow: tuple[Network, ...]) -> None:
    """TargetRefused unless the address is public or in an allowed range."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise TargetRefused(f"webhook host resolves to {text!r}, which is not an IP address") from None
    if any(address in n for n in allow if n.version == address.version):
        return
    reason = why_not_public(address)
    if reason is not None:
        raise TargetRefused(f"webhook target {address} is {reason}; only public addresses are allowed "
                            "(REV88_WEBHOOK_ALLOW_CIDRS adds ranges)")


def resolve(target: Target, allow: tuple[Network, ...]) -> Target:
    """(blocking: a DNS lookup) The target with every address it resolves to, each checked; a
    literal address is checked as it is. TargetRefused if any is refused or none is found."""
    try:
        literal = ipaddress.ip_address(target.host)
    except ValueError:
        literal = None
    if literal is not None:
        found = [str(literal)]
    else:
        try:
            infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, OSError) as exc:
            raise TargetRefused(f"webhook host {target.host!r} cannot be resolved: {exc}") from None
        found = []
        for info in infos:
            text = info[4][0]
            if text not in found:
                found.append(text)
        if not found:
            raise TargetRefused(f"webhook host {target.host!r} resolves to no address")
    for text in found:
        try:
            check_address(text, allow)
        except TargetRefused as exc:
            name = "" if literal is not None else f"{target.host!r} resolves to {text}: "
            raise TargetRefused(f"{name}{exc}") from None
    return dataclasses.replace(target, addresses=tuple(found))
