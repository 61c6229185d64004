"""Round-stream's buffers, the layer between the driver and the kernels: the device memory the
rounds' kernels read and write, and what the host knows of it. A round's shape (Geometry), the
device state of a burst (StreamBufs, with the Ledger of rounds the host has not seen; TreeBufs for
a tree), the tables of what a round rolls back (KV lengths, recurrent state, KV data), the
capacity rule, the acceptance rules, and the row words (layout) that ptx/layout.cuh shares; and
the length chooser's buffers (DraftLengths)."""
from .acceptance import Acceptance, Greedy, Sampling
from .capacity import UNCHECKED, Capacity, CapacityError, i32_kv_capacity, kv_capacity
from .geometry import MAX_BATCH, Geometry
from .ledger import Ledger
from .lengths import DraftLengths
from .stream_bufs import BuffersHeld, Readback, StreamBufs
from .tables import (AddressTable, AllocatedKV, Cache, KVData, KVDataTable, KVLayer, PointerTable, StateIndexTable,
                     StateLayer, StateTable, kv_data_table, kv_len_ptr_table, kv_len_ptr_table_range, state_copy_table,
                     state_copy_table_range, state_flip_table)
from .tree import Candidates, DynamicTree, Tree, TreeBufs, TreeShape

__all__ = ["Acceptance", "AddressTable", "AllocatedKV", "BuffersHeld", "Cache", "Candidates", "Capacity",
           "CapacityError", "DraftLengths", "DynamicTree", "Geometry", "Greedy", "KVData", "KVDataTable", "KVLayer",
           "Ledger", "MAX_BATCH", "PointerTable", "Readback", "Sampling", "StateIndexTable", "StateLayer",
           "StateTable", "StreamBufs", "Tree", "TreeBufs", "TreeShape", "UNCHECKED", "i32_kv_capacity", "kv_capacity",
           "kv_data_table", "kv_len_ptr_table", "kv_len_ptr_table_range", "state_copy_table", "state_copy_table_range",
           "state_flip_table"]
