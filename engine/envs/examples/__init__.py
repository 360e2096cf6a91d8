"""Environments that ship with the engine and learn on the packaged agent model
(``engine/local/agent_model``, which they ask the local server for): a multi-turn
guessing game with feedback between turns (:mod:`.guess_sum`) and a calculator tool
(:mod:`.calculator`). The agent model's build
(``python -m scripts.make_model --environments``) trains on transcripts written by these modules, so
the formats have one source."""
