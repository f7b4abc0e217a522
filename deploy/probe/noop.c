/* The no-op object the probe places where an image cannot load the preload
 * library: no code, no DT_NEEDED, so glibc and musl load it alike. */
int flowlane_noop;
