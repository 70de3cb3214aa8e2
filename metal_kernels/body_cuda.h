  const int ktid = int(threadIdx.x);
  const int kbx = int(blockIdx.x);
  const int kby = int(blockIdx.y);
  const int klane = ktid & 31;
  const int kwarp = ktid >> 5;
#define KSHARED __shared__
#define KBARRIER() __syncthreads()
