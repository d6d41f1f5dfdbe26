"""One weight sync, step by step: plan (`plan.py`) -> check -> select (`select.py`: every tensor; `delta.py`: what can
have changed; `sparse.py`: the elements that changed, as patches, with `patches.py` their codec) -> push (`push.py`,
over the data path of `stream.py`) -> verify (`verify.py`) -> settle -> report; `pipeline.WeightSync` runs them."""
