/* Everything the xfer UCX backend calls: the UCP API (it pulls in the UCS types it uses), and
 * UCS's log handlers (a probe of the transports' peer-failure support is kept out of the log). */
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>
