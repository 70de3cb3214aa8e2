  const int ktid = int(thread_index_in_threadgroup);
  const int kbx = int(threadgroup_position_in_grid.x);
  const int kby = int(threadgroup_position_in_grid.y);
  const int klane = int(thread_index_in_simdgroup);
  const int kwarp = int(simdgroup_index_in_threadgroup);
#define KSHARED threadgroup
#define KBARRIER() threadgroup_barrier(metal::mem_flags::mem_threadgroup)
