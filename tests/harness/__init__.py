"""The test harness: the parity check and its tolerances, spawned gloo ranks, graph capture and the workers that
several test files share."""
