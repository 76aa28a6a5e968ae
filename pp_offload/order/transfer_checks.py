"""Whether an order's OFFLOAD/RELOAD actions are well placed (`check_transfers`): the simulator's check
before it replays an order with copies.

Its own module: a misplaced copy is a user-facing error with its own wording for each way a chunk's
device/host state can go wrong, apart from the replay's timing.
"""

from __future__ import annotations

from pp_offload.order.actions import OFFLOAD, B, F, W

__all__ = ["OffloadOrderError", "check_transfers"]


class OffloadOrderError(ValueError):
    """Raised when OFFLOAD/RELOAD actions are misplaced: a backward pass would need activations that
    are in host memory, a RELOAD has no OFFLOAD before it, an OFFLOAD comes before its F..."""


def check_transfers(rank: int, passes, transfers) -> None:
    """Walk one rank's actions in order and check every chunk's device/host state.

    A chunk is on the device from its F; OFFLOAD moves it to the host, RELOAD back; I, B and W need it
    on the device, and W (or B) frees it. Any other sequence is an `OffloadOrderError` naming the chunk.
    """
    state: dict[tuple[int, int], str] = {}
    t = 0
    for index in range(len(passes) + 1):
        while t < len(transfers) and transfers[t][0] == index:
            _, action, kind, stage, mb = transfers[t]
            t += 1
            now = state.get((stage, mb))
            where = f"rank {rank}: {action}"
            if kind == OFFLOAD:
                if now is None:
                    raise OffloadOrderError(
                        f"{where} comes before {stage}F{mb} on this rank: a chunk can be offloaded only "
                        f"after its forward ran on the rank that holds stage {stage}"
                    )
                if now == "host":
                    raise OffloadOrderError(
                        f"{where}: stage {stage}, microbatch {mb} is already offloaded; "
                        f"insert {stage}RELOAD{mb} between the two OFFLOADs or drop one"
                    )
                if now == "freed":
                    raise OffloadOrderError(
                        f"{where} comes after the last backward of stage {stage}, microbatch {mb}, "
                        f"which already freed its activations; move it between {stage}F{mb} and the backward"
                    )
                state[(stage, mb)] = "host"
            else:
                if now != "host":
                    raise OffloadOrderError(
                        f"{where}: stage {stage}, microbatch {mb} is not offloaded at this point "
                        f"(no {stage}OFFLOAD{mb} before it); a RELOAD must follow its chunk's OFFLOAD"
                    )
                state[(stage, mb)] = "device"
        if index == len(passes):
            break
        stage, kind, mb = passes[index]
        key = (stage, mb)
        if kind == F:
            state[key] = "device"
        elif state.get(key) == "host":
            raise OffloadOrderError(
                f"rank {rank}: {stage}{kind}{mb} needs the activations of stage {stage}, microbatch {mb}, "
                f"but they were offloaded ({stage}OFFLOAD{mb}) and no {stage}RELOAD{mb} comes before "
                f"{stage}{kind}{mb}; insert the RELOAD before the chunk's first backward pass"
            )
        elif kind in (W, B):
            state[key] = "freed"
