"""A script that calls spawn at module level, without the `if __name__ == "__main__":` guard (a mistake the
spawn tests make on purpose): each rank re-imports it and would call spawn again."""
from fastdist.distributed import spawn


def rank_number() -> int:
    import torch.distributed as dist
    return dist.get_rank()


print(spawn(rank_number, 2, timeout=120))
