"""The segment file, in one room: its bytes written (`write`) and read back (`cache`), their block offsets (`ranges`),
their CRC seal (`integrity`), where they live (`places`: local files or a bucket) and the durable-write helpers
(`durable`). The format itself is `replay_format/segment.md`."""
