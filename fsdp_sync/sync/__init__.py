"""One sync, whatever it carries: one body (`frame.SyncFrame.sync`: plan -> check_finite -> push -> agree -> verify ->
publish, the commit point -> report), run by each kind of payload: weights (`pipeline.WeightSync`: its plan in
`plan.py`; what it sends chosen by `select.py`: every tensor, `delta.py`: what can have changed, `sparse.py`: the
elements that changed, as patches, with `patches.py` their codec; the push in `push.py` over the data path of
`stream.py`) and adapters (`adapter.AdapterSync`); the engine read back by `verify.py`."""
