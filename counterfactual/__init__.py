"""Counterfactual speculation: every proposer and depth scored on production's own outputs.

A model-free proposer (vLLM's n-gram / prompt lookup) drafts from the context alone, and a draft
model's greedy drafts are its teacher-forced predictions; so the acceptance a configuration
*would* have had on a request is a pure function of the request's prompt and output token ids
(and, for a draft model, of that model's prediction at every position). Nothing here serves or
calls a model: the gateway's token tap (:mod:`evidence.tokens`) puts the ids in the records.

Layout: ``ngram`` (vLLM's n-gram proposer, every draft of one sequence at once), ``replay`` (the
engine's steps for one configuration along one output), ``grid`` (the configurations scored),
``rules`` (dynamic lookahead: draft-length rules and their replay classes), ``rejections`` (what
the target's token was where drafts were rejected; token texts; drafter vocabularies), ``speed``
(the step-time model: predicted speed-up from acceptance), ``matrix`` (records → one row per
configuration × category × output length, and the picks), ``rows`` (the cells and rows),
``live`` (live candidates: predicted against measured, drift), ``llamacpp_ngram`` and
``llamacpp_replay`` (llama.cpp's ``ngram-mod`` and ``ngram-map-k``: the port, a replayed server,
the rows and the live check against llama.cpp's timings), ``render`` (Markdown and the
policy fragment), ``labels`` (the acceptance and rejection labels of ``specshadow records
export``'s rows) and ``cli`` (``specshadow counterfactual``). Pure Python, no numpy: the gateway
extra stays slim. Method and limits: docs/counterfactual.md.
"""
