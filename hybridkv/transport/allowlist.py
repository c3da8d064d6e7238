"""Which peers may open a control channel to a listener.

ucxx 0.52 listens on every interface (its listener takes a port, not an address), so the address a
producer advertises does not narrow who can reach it. With ``TransportConfig.allowed_peers`` set, a
connection from outside those networks is closed before a byte of it is read; the producer counts it
(``Stats.refused_peers``). A peer whose address cannot be read is refused too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, kw_only=True)
class PeerAllowlist:
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, specs: Iterable[str]) -> PeerAllowlist:
        """Networks from addresses or CIDR blocks ("10.0.0.5", "10.0.0.0/8", "fd00::/8")."""
        networks = []
        for spec in specs:
            try:
                networks.append(ipaddress.ip_network(spec, strict=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"allowed peer {spec!r} is not an IP address or network "
                                 f"(expected e.g. '10.0.0.5' or '10.0.0.0/8'): {exc}") from None
        if not networks:
            raise ValueError("an allowlist needs at least one network (leave allowed_peers empty for any peer)")
        return cls(networks=tuple(networks))

    def allows(self, address: str | None) -> bool:
        ip = None if address is None else canonical_ip(address)
        return ip is not None and any(ip in net for net in self.networks)


def canonical_ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address as one IP whichever way it is written (None: not an IP), an IPv4-mapped IPv6 address as
    its IPv4 one: a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


__all__ = ["PeerAllowlist", "canonical_ip"]
