/* Linked into every kernel library: what it was built from (source, flags, CPU), so the loader can tell a build
 * made for this source and this CPU from a stale or foreign one. SWITCHYARD_BUILD_ID comes from the build command. */
const char *switchyard_build_id(void) { return SWITCHYARD_BUILD_ID; }
