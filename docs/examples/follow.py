#!/usr/bin/env python3
"""Follows the provledger ledger by the rule of docs/following.md, with NATS and JSON only.

    PYTHONPATH=.tools/python python3 follow.py NATS_URL POSITION_FILE [SUBJECT_PREFIX]

(scripts/install-nats-py.sh puts the pinned nats-py in .tools/python; the prefix defaults
to provledger.) Prints one JSON line per change handled, {"position", "aggregate", "events":
[names]}, then stores its position in POSITION_FILE, and starts after the stored one when
run again: a change is handled again only if the process died before storing it (at least
once, in position order), and none is ever skipped.
"""

import asyncio
import json
import os
import sys

import nats

FEED_SILENCE_MAX_S = 15  # serve sends a bookmark every 5 s: 15 s of nothing is suspect
FEED_BUFFER_MSGS = 256  # unread feed messages nats-py keeps; it drops the rest (see prev)
PAGE_CHANGES_MAX = 1000  # changes asked for per catch-up page
REPLY_WAIT_S = 10
RETRY_FOR_S = 30  # how long a catch-up retries a busy (`unavailable`) or absent serve


def load_position(path):
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return 0  # nothing handled yet: follow from position 1


def store_position(path, position):
    # A whole new file renamed over the old one: a crash leaves the old or the new number,
    # never half of one.
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{position}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


class Follower:
    def __init__(self, nc, prefix, path):
        self.nc, self.prefix, self.path = nc, prefix, path
        self.position = load_position(path)  # every change up to here is handled

    def handle(self, change):
        names = [name for event in change["events"] for name in event]  # {"name": {...}}
        line = {"position": change["position"], "aggregate": change["aggregate"], "events": names}
        print(json.dumps(line), flush=True)
        self.position = change["position"]
        store_position(self.path, self.position)

    async def changes_after(self, position):
        """One page of `q.changes`; a busy serve (`unavailable`) is asked again shortly."""
        subject = f"{self.prefix}.q.changes"
        request = json.dumps({"after": position, "limit": PAGE_CHANGES_MAX}).encode()
        backoff, waited = 0.1, 0.0
        while True:
            try:
                reply = await self.nc.request(subject, request, timeout=REPLY_WAIT_S)
                body = json.loads(reply.data)
                if "error" not in body:
                    return body["data"]
                if body["error"].get("code") != "unavailable":
                    sys.exit(f"q.changes refused: {body['error']}")
                reason = body["error"].get("message")
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
                reason = f"{e!r} (is provledger serve running?)"
            if waited >= RETRY_FOR_S:
                sys.exit(f"q.changes: no answer for {RETRY_FOR_S} s: {reason}")
            await asyncio.sleep(backoff)
            waited, backoff = waited + backoff, min(backoff * 2, 2.0)

    async def catch_up(self, why):
        print(f"catching up after {self.position}: {why}", file=sys.stderr, flush=True)
        while True:
            page = await self.changes_after(self.position)
            for change in page["changes"]:
                self.handle(change)
            # `next` is the last position the page looked at, handled or not.
            self.position = max(self.position, page["next"])
            if page["next"] >= page["end"]:
                return  # current: the feed takes over

    async def follow(self):
        # Subscribe (and flush, so the server knows) before catching up: a change published
        # while the catch-up reads is then heard on the feed.
        subject = f"{self.prefix}.feed.>"
        feed = await self.nc.subscribe(subject, pending_msgs_limit=FEED_BUFFER_MSGS)
        await self.nc.flush()
        await self.catch_up("start")
        while True:
            try:
                msg = await feed.next_msg(timeout=FEED_SILENCE_MAX_S)
            except nats.errors.TimeoutError:
                await self.catch_up(f"the feed was silent for {FEED_SILENCE_MAX_S} s")
                continue
            body = json.loads(msg.data)
            if msg.subject == f"{self.prefix}.feed.bookmark":
                if body["position"] > self.position:
                    await self.catch_up(f"bookmark {body['position']}")
            elif body["position"] <= self.position:
                pass  # a duplicate: the catch-up or another replica gave it already
            elif body["prev"] > self.position:
                await self.catch_up(f"missed changes (prev {body['prev']})")
            else:
                self.handle(body)


async def main(url, path, prefix="provledger"):
    async def on_error(e):
        # A full feed buffer drops messages (a slow consumer): prev shows what was lost.
        if not isinstance(e, nats.errors.SlowConsumerError):
            print(f"nats: {e!r}", file=sys.stderr, flush=True)

    nc = await nats.connect(url, error_cb=on_error)
    await Follower(nc, prefix, path).follow()


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    asyncio.run(main(*sys.argv[1:]))
