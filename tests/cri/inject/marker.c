/* An application's own preload library (the role jemalloc or tcmalloc plays):
 * says on stderr that it was loaded. */
#include <unistd.h>

__attribute__((constructor)) static void loaded(void) {
    static const char msg[] = "own-preload-loaded\n";
    (void)!write(2, msg, sizeof msg - 1);
}
