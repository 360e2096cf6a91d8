"""Environments that ship with the engine and learn on the packaged default model: a
multi-turn guessing game with feedback between turns (:mod:`.guess_sum`) and a
calculator tool (:mod:`.calculator`). The default model's build
(``python -m scripts.make_model``) trains on transcripts written by these modules, so
the formats have one source."""
