  const int ktid = kemu::cur;
  const int kbx = kemu::bx;
  const int kby = kemu::by;
  const int klane = ktid & 31;
  const int kwarp = ktid >> 5;
#define KSHARED static
#define KBARRIER() kemu::barrier()
