"""A network namespace with two veth links to the host, for a replica that is cut off its storage mid-test.

Needs root and iproute2 (`ip netns`, `ip link ... type veth`). `Island` makes one namespace and two point-to-point
links into it, each a /30 of 10.0.0.0/8 no host interface uses:

- `client`: the test's writers and readers reach the replica in the namespace through it (the replica listens on
  `client.inner`);
- `storage`: the replica reaches PostgreSQL and the S3 server through it (they listen on `storage.outer` too).

`cut()` takes the storage link down on the namespace's side: the replica stays reachable, but its index and bucket
are gone (new connections fail with "network unreachable", open ones stall); `restore()` brings it back. Names are
unique per run (a short random tag), so runs side by side and leftovers of a killed run never collide; `close()`
deletes the namespace and both links and is safe to call after a failed `open()`.
"""

from __future__ import annotations

import ipaddress
import random
import subprocess
import uuid
from dataclasses import dataclass


def ip(*args: str, netns: str | None = None) -> str:
    """Run one `ip` command (inside `netns` when given); its output; a clear error naming the command."""
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Link:
    """One veth pair: `outer_dev` on the host with `outer`, `inner_dev` in the namespace with `inner` (a /30)."""

    outer_dev: str
    inner_dev: str
    outer: str
    inner: str


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """`count` /30 networks inside one random /24 of 10.0.0.0/8 that overlaps no address the host has."""
    used = [ipaddress.ip_interface(word).network for line in ip("-4", "-o", "addr", "show").splitlines()
            for i, word in enumerate(line.split()) if i > 0 and line.split()[i - 1] == "inet"]
    for _ in range(100):
        block = ipaddress.IPv4Network(f"10.{random.randrange(64, 250)}.{random.randrange(256)}.0/24")
        if not any(block.overlaps(net) for net in used):
            return list(block.subnets(new_prefix=30))[:count]
    raise RuntimeError("no free 10.x.y.0/24 for the test's veth links")


class Island:
    """A network namespace reached through a `client` link and reaching storage through a `storage` link."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"replay-{tag}"
        self.tag = tag
        self.client: Link | None = None
        self.storage: Link | None = None
        self._made: list[str] = []  # host-side devices made so far, deleted by close() whatever failed after

    def open(self) -> Island:
        """Make the namespace and both links, addressed and up (loopback up inside too)."""
        ip("netns", "add", self.name)
        ip("link", "set", "lo", "up", netns=self.name)
        client, storage = _free_subnets(2)
        self.client = self._link("c", client)
        self.storage = self._link("s", storage)
        return self

    def _link(self, kind: str, net: ipaddress.IPv4Network) -> Link:
        outer, inner = (str(host) for host in list(net.hosts())[:2])
        link = Link(f"rp{self.tag}{kind}o", f"rp{self.tag}{kind}i", outer, inner)  # 10 characters: under IFNAMSIZ
        self._made.append(link.outer_dev)
        ip("link", "add", link.outer_dev, "type", "veth", "peer", "name", link.inner_dev)
        ip("link", "set", link.inner_dev, "netns", self.name)
        ip("addr", "add", f"{outer}/30", "dev", link.outer_dev)
        ip("link", "set", link.outer_dev, "up")
        ip("addr", "add", f"{inner}/30", "dev", link.inner_dev, netns=self.name)
        ip("link", "set", link.inner_dev, "up", netns=self.name)
        return link

    def cut(self) -> None:
        """Take the storage link down on the namespace's side: its index and bucket become unreachable."""
        assert self.storage is not None
        ip("link", "set", self.storage.inner_dev, "down", netns=self.name)

    def restore(self) -> None:
        """Bring the storage link up again (its address and route come back with it)."""
        assert self.storage is not None
        ip("link", "set", self.storage.inner_dev, "up", netns=self.name)

    def close(self) -> None:
        """Delete both links and the namespace; what is already gone is skipped (safe after a failed open)."""
        for dev in self._made:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)  # takes its peer along
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def __enter__(self) -> Island:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
