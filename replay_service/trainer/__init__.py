"""The service's trainer side: lay one rank's router tokens out and serve their rows as a trainer slice.

The query is `replay_format.trainer_query`'s (the API model converts a body into it); `plans`
chooses its token plan (Megatron or verl) and refuses what it can before the store is read;
`layouts` plans the tokens (pure numpy: Megatron THD/BSHD with CP and SP slices, verl dense);
`conventions` is each trainer's THD padding rule (verl, slime, miles); `gather` fills a plan with
ids on the MoE or model-layer axis and applies the missing-row policy; `reads.read_slice` reads
only those rows from the store and builds the answer (replay_format/trainer_slice.md);
`replay_service.api.trainer` is the thin HTTP router. The trainer's own side is `replay_client.trainer`.
"""
