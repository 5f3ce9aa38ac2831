"""The id rules of vLLM's answers, where the client has always offered them: they live in `replay_format.vllm_ids`
(the service maps a whole response's choices with the same rules)."""

from replay_format.vllm_ids import Endpoint, choice_request_ids, response_request_ids, stored_request_id

__all__ = ["Endpoint", "choice_request_ids", "response_request_ids", "stored_request_id"]
