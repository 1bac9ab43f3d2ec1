/* Everything the xfer UCX backend calls: the UCP API (it pulls in the UCS types it uses). */
#include <ucp/api/ucp.h>
